"""A rank program for the trace test: DDP steps and a few collectives with
FERROGRPC_TRACE set by the test. Usage: trace_skew.py SKEWED SKEW.

Rank SKEWED's wall clock reads SKEW seconds ahead (``time.time`` patched
for the whole process, as on a host whose clock is off), so only the
measured offset can line its events up with the others'. Every rank exits
without closing its backend: the trace is written at interpreter exit.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import ferrogrpc as fg


def main() -> None:
    skewed, skew = int(sys.argv[1]), float(sys.argv[2])
    if int(os.environ["RANK"]) == skewed:
        real = time.time
        time.time = lambda: real() + skew
    backend = fg.init_backend()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = fg.DDP(model, backend, bucket_size_bytes=256)
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + backend.rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp.sync_gradients()
        backend.all_reduce(torch.ones(1 << 16))
    print(f"OK rank {backend.rank} buckets {len(ddp.bucket_layout())}", flush=True)


if __name__ == "__main__":
    main()
