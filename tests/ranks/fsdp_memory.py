"""A rank program: FSDP's resident memory measured by the kernel, not by the
wrapper's own accounting. Prints ``FULL <bytes>`` (the model's parameter
bytes), ``EXTRA <stage> <bytes>`` for each stage (this process's RSS over
the RSS before the model was built) and OK.

Run it with glibc's mmap threshold fixed low (``MALLOC_MMAP_THRESHOLD_``,
and ``FERROGRPC_MALLOC_TUNING=0`` so that ferrogrpc leaves it alone): every
large buffer is then its own mapping, and freeing it leaves the RSS at
once. A first step on a throwaway model of the same shape grows the
transport's and allocator's buffers before the baseline is taken, so that
what the real model's stages add is its own."""

from __future__ import annotations

import gc
import sys

import torch
from torch import nn

import ferrogrpc as fg

WIDTH = 2896  # a 2896 x 2896 float32 weight: 32 MiB (half the suite time of 64)
LAYERS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def step(fsdp: fg.FSDP, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    fsdp(x).pow(2).sum().backward()
    fsdp.sync_gradients()
    opt.step()
    opt.zero_grad()  # the shards' gradients go too: parameters only remain


def main() -> None:
    backend = fg.init_backend()
    rank, world = backend.rank, backend.world_size
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
    with backend:
        warm = fg.FSDP(model(), backend)
        step(warm, torch.optim.SGD(warm.parameters(), lr=0.01), x)
        del warm
        gc.collect()
        backend.barrier()
        base = fg.testing.rss()

        def extra(stage: str) -> None:
            gc.collect()
            print(f"EXTRA {stage} {fg.testing.rss() - base}", flush=True)

        inner = model()
        full = sum(p.numel() * p.element_size() for p in inner.parameters())
        print(f"FULL {full}", flush=True)
        extra("model")
        fsdp = fg.FSDP(inner, backend)
        extra("wrapped")
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.01)
        for i in range(2):
            step(fsdp, opt, x)
            extra(f"step{i}")
    print(f"OK rank {rank}/{world}", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
