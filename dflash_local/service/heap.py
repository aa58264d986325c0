"""The C heap's free pages given back to the system once a batch drains: glibc keeps what the
generations' tensors and buffers freed in its arenas (one per thread that allocated), so the
process's resident size would stay at the batch's peak. glibc only; elsewhere nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def trim_heap() -> bool:
    """glibc's `malloc_trim(0)`: True when it gave memory back; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return False
    return bool(trim is not None and trim(0))
