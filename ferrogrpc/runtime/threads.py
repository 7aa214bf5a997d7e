"""Run the backend loop thread's reductions and copies on that thread alone.

torch parallelises an elementwise op over a chunk (an ``add`` of 1M floats)
with OpenMP. On the loop thread that buys nothing: a collective is bound by
memory and by gRPC, and the training threads, other ranks and gRPC's own
threads want the same cores. When ranks share cores (several ranks per
machine, or a busy host) it costs a lot: the loop thread stalls at the end of
every parallel region for an OpenMP worker that is not scheduled, and idle
workers spin. Gloo's reductions are single-threaded for the same reason.
Measured on the 2-core reference machine at world size 4: a 64 MiB
all_reduce took 183 ms with torch's default of 2 threads and 155 ms with 1.

OpenMP's thread count is a per-thread setting, so this changes only the
calling thread; the training loop's own ops keep torch's setting. It is
called on the backend's loop thread when it starts. ``FERROGRPC_REDUCE_THREADS``
(Settings.reduce_threads) sets another count (``0`` leaves torch's setting
alone).
"""

from __future__ import annotations

import ctypes
import os


def _loaded_gomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch loaded, whatever its file is called
    (wheels may bundle it as ``libgomp-<hash>.so.1``); one inside torch's
    package (``torch/lib``, ``torch.libs``) first; never loads one."""
    import torch

    torch_prefix = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torch")
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "libgomp" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    paths.sort(key=lambda path: not path.startswith(torch_prefix))
    for name in [*paths, "libgomp.so.1"]:
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
    return None


def limit_thread_intraop(count: int) -> int | None:
    """Set the calling thread's OpenMP thread count for torch's CPU ops.

    Returns the count set, or None when nothing was changed: ``count`` is 0,
    or torch is not built with GNU OpenMP (the setting is then left as is).
    """
    if count <= 0:
        return None
    import torch

    # torch initialises a thread's OpenMP count from its global setting on
    # the thread's first parallel op; do that first, so it cannot later
    # overwrite the count set here.
    torch.get_num_threads()
    gomp = _loaded_gomp()
    if gomp is None:
        return None
    try:
        set_threads = gomp.omp_set_num_threads
    except AttributeError:
        return None
    set_threads.argtypes = [ctypes.c_int]
    set_threads.restype = None
    set_threads(count)
    return count
