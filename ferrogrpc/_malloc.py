"""Keep glibc from returning chunk-sized buffers to the OS after every use.

Every received chunk is a fresh ~1 MiB bytes object, and every sent one is
another. With glibc's defaults such buffers are mmapped or trimmed back to
the OS when freed, so each chunk pays for page faults on first touch; on the
2-core reference machine that cost ~15% of all_reduce bandwidth. Raising the
mmap and trim thresholds lets freed buffers be reused warm. Process-wide, so
it is done once, when the first Peer starts; ``FERROGRPC_MALLOC_TUNING=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MALLOC_TUNING_ENV = "FERROGRPC_MALLOC_TUNING"

_done = False


def tune_allocator(mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Raise glibc's mmap and trim thresholds once per process. Returns
    whether it was applied (False off glibc or when disabled)."""
    global _done
    if _done:
        return True
    if os.environ.get(MALLOC_TUNING_ENV, "1") in (
        "0",
        "false",
        "no",
    ) or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
    _done = ok
    return ok
