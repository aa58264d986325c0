"""dflash-local: fast local LLM chat with DFlash speculative decoding.

The core package imports no ML framework at module scope: engines load lazily.
"""

__version__ = "0.1.0"
