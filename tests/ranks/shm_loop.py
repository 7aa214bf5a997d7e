"""A rank program for the segment-leak test: joins, runs all_reduces on the
same-host plane until killed. Prints "ready" after the first one."""

from __future__ import annotations

import sys

import torch

import ferrogrpc as fg


def main() -> None:
    backend = fg.init_backend()
    t = torch.ones(1 << 20)
    backend.all_reduce(t)
    sys.stdout.write(f"ready {backend.rank} {backend.data_path}\n")
    sys.stdout.flush()
    while True:
        backend.all_reduce(t)


if __name__ == "__main__":
    main()
