"""A rank program: ``dist.init_process_group`` over ``ferrogrpc`` by one
way in, then an all_reduce, checked. Usage: ``torch_init.py MODE [ARG]``
with MODE env (torchrun's variables), tcp, file PATH, store, or devicemap.
Prints ``OK <mode> <data path>``."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from ferrogrpc.wrappers.process_group import FerroProcessGroup


def main() -> None:
    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if mode == "env":
        dist.init_process_group("ferrogrpc")
    elif mode == "tcp":
        dist.init_process_group(
            "ferrogrpc", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world
        )
    elif mode == "file":
        dist.init_process_group(
            "ferrogrpc", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=world
        )
    elif mode == "store":
        store = dist.TCPStore(
            addr, port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
        )
        dist.init_process_group(
            "ferrogrpc", store=store, rank=rank, world_size=world, pg_options={"shm": False}
        )
    elif mode == "devicemap":
        dist.init_process_group("cpu:ferrogrpc,cuda:ferrogrpc")
    else:
        raise SystemExit(f"unknown mode {mode}")
    pg = dist.group.WORLD
    assert isinstance(pg, FerroProcessGroup), pg
    t = torch.full((5,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), world * (world + 1) / 2)), t
    path = pg.backend.data_path
    dist.destroy_process_group()
    sys.stdout.write(f"OK {mode} {path}\n")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Closed already: end now, without torch's exit-time destructors (0.7 s
    # of CPU a process, which the suite would pay hundreds of times).
    os._exit(0)
