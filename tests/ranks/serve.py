"""A rank program driven line by line on stdin, for tests that act on a
running job from outside (an attacker, a probe). Prints ``READY rank
address pid`` once the group formed, then answers each command:

- ``all_reduce``: a float64 all_reduce of seeded inputs, checked against the
  float64 sum of every rank's inputs; prints ``OK <max abs error>``;
- ``all_reduce_int OP``: an all_reduce of an int64 tensor with reduce op OP;
  prints ``OK`` or the error's class and message on one line;
- ``small N``: the same with N elements (a small collective, run on the
  direct sockets when every rank shares this host); prints ``OK <max abs
  error>``, or the error's class and message on one line;
- ``quit``: closes the backend and exits.
"""

from __future__ import annotations

import os
import sys

import torch

import ferrogrpc as fg

NUMEL = 1 << 20


def inputs(rank: int, step: int, numel: int = NUMEL) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64)


def main() -> None:
    backend = fg.init_backend()
    rank, world = backend.rank, backend.world_size
    print(f"READY {rank} {backend.address} {os.getpid()}", flush=True)
    step = 0
    with backend:
        for line in sys.stdin:
            command = line.strip()
            if command == "all_reduce":
                step += 1
                t = inputs(rank, step)
                backend.all_reduce(t)
                ref = torch.stack([inputs(r, step) for r in range(world)]).sum(0)
                print(f"OK {float((t - ref).abs().max()):.3g}", flush=True)
            elif command.startswith("all_reduce_int "):
                try:
                    backend.all_reduce(torch.ones(1000, dtype=torch.int64), command.split()[1])
                except fg.FerroGrpcError as exc:
                    print(f"{type(exc).__name__} {exc}".replace("\n", " "), flush=True)
                else:
                    print("OK", flush=True)
            elif command.startswith("small "):
                step += 1
                numel = int(command.split()[1])
                t = inputs(rank, step, numel)
                try:
                    backend.all_reduce(t)
                except fg.FerroGrpcError as exc:
                    print(f"{type(exc).__name__} {exc}".replace("\n", " "), flush=True)
                    continue
                ref = torch.stack([inputs(r, step, numel) for r in range(world)]).sum(0)
                print(f"OK {float((t - ref).abs().max()):.3g}", flush=True)
            elif command == "quit":
                break
            else:
                print(f"unknown command {command!r}", flush=True)
    print("BYE", flush=True)


if __name__ == "__main__":
    main()
