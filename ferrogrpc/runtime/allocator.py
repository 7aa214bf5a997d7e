"""Tune glibc's allocator for chunk-sized buffers, once per process.

Two effects, both measured on the 2-core reference machine:

- **Warm buffers.** Every received chunk is a fresh ~1-4 MiB bytes object,
  and every sent one is another. With glibc's defaults such buffers are
  mmapped or trimmed back to the OS when freed, so each chunk pays for page
  faults on first touch: ~15% of all_reduce bandwidth. Raising the mmap and
  trim thresholds lets freed buffers be reused warm.
- **One arena.** gRPC reads on its own threads, and ferrogrpc copies and
  reduces on the backend's loop thread. With glibc's per-thread arenas each
  thread's arena keeps its own high-water mark, so a rank's peak RSS became
  the *sum* of them: 74-121 MiB extra during a first 256 MiB all_reduce at
  world size 4, against 46-68 MiB with every thread in one arena, at the
  same speed (all_reduce and DDP steps alike). The price: all threads'
  larger mallocs take one lock (small ones come from per-thread caches).

  ``M_ARENA_MAX`` only caps the creation of arenas: a thread that already
  has one keeps it, and threads started later share whichever arenas exist.
  So the effect is full when ferrogrpc initialises before other threads
  allocate, which is why the Backend applies it before it starts its loop
  thread; in a process whose other threads (gloo's, a DataLoader's pin
  thread) came first it is partial. A cap the user set
  (``MALLOC_ARENA_MAX``, or ``arena_max`` in ``GLIBC_TUNABLES``) is kept.

Process-wide, so it is done once, when the first Backend or Peer starts;
``FERROGRPC_MALLOC_TUNING=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_done = False


def tune_allocator(
    enabled: bool,
    cap_arenas: bool = True,
    mmap_threshold: int = 64 << 20,
    trim_threshold: int = 256 << 20,
    arena_max: int = 1,
) -> bool:
    """Raise glibc's mmap and trim thresholds and, with ``cap_arenas``, cap
    its arenas, once per process. ``enabled`` and ``cap_arenas`` come from
    Settings (``FERROGRPC_MALLOC_TUNING``; a user's own arena cap). Returns
    whether it was applied (False off glibc or when disabled)."""
    global _done
    if _done:
        return True
    if not enabled or not sys.platform.startswith("linux"):
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
    settings = [(_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold)]
    if cap_arenas:
        settings.append((_M_ARENA_MAX, arena_max))
    ok = all([mallopt(option, value) for option, value in settings])
    _done = ok
    return ok
