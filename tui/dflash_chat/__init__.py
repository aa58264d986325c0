"""dflash-chat: the Textual chat app, a client of the dflash-local HTTP service only.

Boundary: no model code and no ML framework here. `client.py` holds all HTTP, `service.py`
starts the service as a child process; `storage.py`, `settings.py` and `stats.py` are plain
Python (no Textual), the screens and widgets are Textual.
"""

__version__ = "0.1.0"
