"""A rank program: the extra peak RSS of this process's first all_reduces of
a large float32 tensor, sampled on a thread, over the RSS just before.
Prints ``PEAK_EXTRA <bytes>`` and OK once the results are checked."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

import ferrogrpc as fg


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
        base = rss()
        peak = base
        running = True

        def sample() -> None:
            nonlocal peak
            while running:
                peak = max(peak, rss())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            for _ in range(calls):
                backend.all_reduce(t)
        finally:
            running = False
            sampler.join()
        peak = max(peak, rss())
        expected = float(world * (world + 1) // 2 * world ** (calls - 1))
        assert bool(t.eq(expected).all()), (rank, t[:4], expected)
        print(f"PEAK_EXTRA {peak - base}", flush=True)
    print(f"OK rank {rank}/{world}", flush=True)


if __name__ == "__main__":
    main()
