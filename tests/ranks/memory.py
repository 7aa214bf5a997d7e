"""A rank program: the extra peak RSS of this process's first all_reduces of
a large float32 tensor over the RSS just before them, the shared memory it
mapped meanwhile, and the number of glibc malloc arenas afterwards. Prints
``PEAK_EXTRA <bytes>``, ``SHARED <bytes>``, ``PATH <data path>``, ``ARENAS
<n>`` and OK once the results are checked."""

from __future__ import annotations

import ctypes
import sys
import tempfile

import torch

import ferrogrpc as fg


def arenas() -> int:
    """glibc's malloc arenas in this process (``<heap nr=`` in malloc_info)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
        stream = libc.fopen(tmp.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        return open(tmp.name).read().count("<heap nr=")


def rss_shmem() -> int:
    """Resident shared memory of this process: the same-host plane's
    segments it has touched (its own and its peers')."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    numel = int(sys.argv[1]) // 4
    calls = int(sys.argv[2])
    backend = fg.init_backend()
    rank, world = backend.rank, backend.world_size
    with backend:
        # rank + 1 everywhere: every partial sum is a small integer, exact in
        # float32, so the result is checked exactly.
        t = torch.full((numel,), float(rank + 1))
        backend.barrier()
        base, shared = fg.testing.rss(), rss_shmem()

        def run() -> None:
            for _ in range(calls):
                backend.all_reduce(t)

        peak = fg.testing.peak_rss(run)
        expected = float(world * (world + 1) // 2 * world ** (calls - 1))
        assert bool(t.eq(expected).all()), (rank, t[:4], expected)
        print(f"PEAK_EXTRA {peak - base}", flush=True)
        print(f"SHARED {rss_shmem() - shared}", flush=True)
        print(f"PATH {backend.data_path}", flush=True)
        print(f"ARENAS {arenas()}", flush=True)
    print(f"OK rank {rank}/{world}", flush=True)


if __name__ == "__main__":
    main()
