"""A rank program: destroy the ferrogrpc process group and create it again,
three times in one process, through one explicit store and through env://;
an all_reduce each time must be right. Prints ``OK <how> <i>`` and ``DONE``."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

import ferrogrpc  # noqa: F401 - registers the "ferrogrpc" backend


def check(rank: int, world: int) -> None:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [world * (world + 1) / 2] * 4, t


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["STORE_PORT"]),
        world,
        is_master=rank == 0,
        timeout=timeout,
    )
    for i in range(3):
        dist.init_process_group(
            "ferrogrpc", store=store, rank=rank, world_size=world, timeout=timeout
        )
        check(rank, world)
        dist.destroy_process_group()
        print(f"OK store {i}", flush=True)
    for i in range(3):
        dist.init_process_group("ferrogrpc", timeout=timeout)
        check(rank, world)
        dist.destroy_process_group()
        # env:// reuses MASTER_PORT: a rank that raced ahead would connect to
        # rank 0's previous TCPStore before rank 0 destroyed it, and the new
        # store would wait out its timeout for that rank (torch's env:// does
        # the same over gloo). The outer store says when every group is gone.
        # (Not after the last: rank 0 may exit, and its outer store with it.)
        if i < 2:
            store.set(f"gone/{i}/{rank}", "1")
            store.wait([f"gone/{i}/{r}" for r in range(world)])
        print(f"OK env {i}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Closed already: end now, without torch's exit-time destructors (0.7 s
    # of CPU a process, which the suite would pay hundreds of times).
    os._exit(0)
