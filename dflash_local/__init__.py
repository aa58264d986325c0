"""dflash-local: fast local LLM chat with DFlash speculative decoding.

The core package imports no ML framework at module scope: engines load lazily.
"""

import os

__version__ = "0.1.0"

# Set before torch starts oneDNN: the packed linears (accel/torch_linear.py) leave a primitive per
# distinct row count in oneDNN's cache and in ideep's, ~0.5 MB each and 1024 of each by default;
# the lanes' ragged batches see many row counts, so a drained batch kept ~100 MiB. 32 holds a
# round's working set, and a miss costs less than a hit on a cold entry
# (scripts/experiments/onednn_cache_memory.py, docs/records/onednn-cache-memory.json).
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, "32")
