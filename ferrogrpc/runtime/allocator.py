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
``FERROGRPC_MALLOC_TUNING=0`` turns it off. A threshold the user set
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or in
``GLIBC_TUNABLES``) is kept, as the arena cap is.

[Note: the mmap threshold trades memory for page faults]
Blocks of 64 MiB or more are still mmapped, and unmapped when freed. A
``Linear(4096, 4096)``'s weight gradient is 64 MiB exactly, allocated
afresh by every backward: so every step faults it in page by page.
In the 25.2M-parameter MLP of the benchmarks (one such layer) that is 16.6k
faults a step, and a step of the model alone took 0.153 s of CPU against
0.103 s with the threshold at 128 MiB (2026-12-04, one rank, one thread).
Raising the default would keep such gradients warm, and it costs memory:
with the threshold at 512 MiB, ``bench_train --wrapper fsdp`` (six 64 MiB
layers) ran every implementation's step 1.5-2.3x faster but raised every
peak RSS (torch FSDP2 638 -> 1820 MiB, ferrogrpc FSDP with units 856 ->
1425), as freed layers stayed in the heap. So the default keeps the peak
down, and a rank whose memory allows sets the threshold itself, for
example ``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912``.

DDP is the exception (:func:`keep_warm`). Its gradients are allocated
afresh by every backward, at the same sizes, and each is freed once copied
into its bucket: a heap serves that pattern without a fault, and a freed
gradient is there for the next step's. So a DDP of CPU parameters raises
the threshold (and the trim threshold, to twice it) above its largest
gradient, up to :data:`WARM_MAX`. What that costs: up to one largest
gradient kept in the heap between steps, not a higher peak (the gradient
is allocated at the peak anyway). Only a threshold this tuning set is
raised; one the user set is theirs. Not every step: now and then the heap
grows by a whole gradient while it holds ~250 MiB free in pieces (one
``Linear(4096, 4096)`` at world size 1: 1 step in 150 alone, 3 in 10 once
under the test suite's load; mallinfo2 showed the arena +64 MiB, its free
bytes +64 MiB), and that step faults the gradient in.

[Note: a warm heap for a joiner]
A process that joins a running elastic group starts with a small heap.
What it allocates once admitted (the gRPC buffers its state arrives in,
the optimizer's state, its first gradients and DDP's buckets) is then
fresh memory, faulted in page by page while every member waits for its
first step. :func:`warm_heap` lets it fault that memory in beforehand,
while it waits to be admitted: it allocates and touches blocks, then frees
them, and the heap keeps them (under a trim threshold raised to twice
that) for the next allocations. ElasticState does it on a joiner, for its
gradients, DDP's two buckets, the optimizer's state, and as much again as
a gradient for the buffers the transfer passes through. Measured at 100 MB
of model and Adam state (``client.bench --elastic``, four runs each,
alternated): the joiner's whole receipt took 0.109-0.129 s instead of
0.172-0.220, and the members' pause was 0.134-0.164 s instead of
0.160-0.185. DDP fills its second bucket in the second step: left out of
the warming (under the old cap of half the trim threshold), its 33.6 MB
faulted in page by page (6-14k faults, 0.11-0.16 s) while every member
waited; warmed, its first step faults none of it, its second 1-3k pages.
The price of the raised trim threshold: a joiner's heap keeps what the
transfer's buffers used (about a gradient's worth) free between steps,
where glibc's default would hand it back.

An FSDP joiner's shards are empty until it is admitted, so ElasticState
warms for the shards it will hold (``ElasticShards.held_bytes``: shard and
copy with their optimizer state, and both gradients) at the world size the
last heartbeat foretold (its members, the joiners waiting, and itself).
Measured on a 25M-parameter model, 3 -> 4 ranks: the joiner's page faults
in its re-shard fell from 77k to 0.3-2.7k, and its CPU in it from 0.27 s
to 0.19-0.21 s. Its receipt was not faster on 2 cores: there the members'
sends and their own new planes hold the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import torch

from ..env import Settings

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_done = False
# libc's mallopt, once the tuning applied; and the mmap and trim thresholds
# it set (None: it set none, or the user set that one).
_mallopt: Any = None
_mmap_set: int | None = None
_trim_set: int | None = None

# The most keep_warm raises the mmap threshold to: a larger gradient is
# mapped and unmapped each step, as glibc does by default.
WARM_MAX = 256 << 20
# The most warm_heap faults in (and keeps free in the heap, under a trim
# threshold raised to twice it).
WARM_HEAP_MAX = 1 << 30


def tune_allocator(
    enabled: bool,
    cap_arenas: bool = True,
    set_mmap: bool = True,
    set_trim: bool = True,
    mmap_threshold: int = 64 << 20,
    trim_threshold: int = 256 << 20,
    arena_max: int = 1,
) -> bool:
    """Raise glibc's mmap threshold (with ``set_mmap``) and trim threshold
    (with ``set_trim``), and with ``cap_arenas`` cap its arenas, once per
    process. The flags come from Settings (``FERROGRPC_MALLOC_TUNING``; a
    setting the user made themselves is kept). Returns whether it was
    applied (False off glibc or when disabled)."""
    global _done, _mallopt, _mmap_set, _trim_set
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
    wanted = [
        (set_mmap, _M_MMAP_THRESHOLD, mmap_threshold),
        (set_trim, _M_TRIM_THRESHOLD, trim_threshold),
        (cap_arenas, _M_ARENA_MAX, arena_max),
    ]
    settings = [(option, value) for wants, option, value in wanted if wants]
    ok = all([mallopt(option, value) for option, value in settings])
    _done = ok
    if ok:
        _mallopt = mallopt
        _mmap_set = mmap_threshold if set_mmap else None
        _trim_set = trim_threshold if set_trim else None
    return ok


def keep_warm(nbytes: int) -> bool:
    """Keep blocks of ``nbytes`` in the heap when freed, rather than mapped
    and unmapped (see [Note: the mmap threshold trades memory for page
    faults]): raise the mmap threshold this process's tuning set above
    ``nbytes`` (never above :data:`WARM_MAX`, never lower), and its trim
    threshold to twice that. Returns whether blocks of ``nbytes`` now stay
    in the heap."""
    global _mmap_set, _trim_set
    if _mallopt is None or _mmap_set is None:
        return False
    # glibc maps a block whose size with its header reaches the threshold.
    wanted = -(-(nbytes + 1) // (1 << 20)) * (1 << 20)
    if wanted <= _mmap_set:
        return True
    if wanted > WARM_MAX:
        return False
    if not _mallopt(_M_MMAP_THRESHOLD, wanted):
        return False
    _mmap_set = wanted
    if _trim_set is not None and _trim_set < 2 * wanted and _mallopt(_M_TRIM_THRESHOLD, 2 * wanted):
        _trim_set = 2 * wanted
    return True


def tune_for(s: Settings) -> bool:
    """:func:`tune_allocator` as ``s`` asks: off with
    ``FERROGRPC_MALLOC_TUNING=0``; a threshold or an arena cap the user set
    in glibc's own variables is left as they set it."""
    return tune_allocator(
        s.malloc_tuning is not False,
        cap_arenas=not s.user_arena_max,
        set_mmap=not s.user_mmap_threshold,
        set_trim=not s.user_trim_threshold,
    )


def warm_heap(nbytes: int) -> int:
    """Fault in up to ``nbytes`` (at most :data:`WARM_HEAP_MAX`) of heap now
    and leave it free in the heap (see [Note: a warm heap for a joiner]),
    in blocks below this tuning's mmap threshold; its trim threshold is
    raised to twice that, as :func:`keep_warm` does. Returns the bytes
    warmed (0 without the tuning, or with a trim threshold the user set)."""
    global _trim_set
    if _mallopt is None or _mmap_set is None or _trim_set is None:
        return 0
    total = min(nbytes, WARM_HEAP_MAX)
    if 2 * total > _trim_set:
        if not _mallopt(_M_TRIM_THRESHOLD, 2 * total):
            total = _trim_set // 2
        else:
            _trim_set = 2 * total
    block = _mmap_set // 4
    blocks = [
        torch.empty(min(block, total - at), dtype=torch.uint8).fill_(0)
        for at in range(0, total, block)
    ]
    del blocks
    return total
