"""A rank program: torch's DistributedDataParallel over the ``ferrogrpc``
backend; in the third step the victim (rank 1) SIGKILLs itself from a
gradient hook, while DDP's bucket all_reduces are in flight. The survivor
must raise (as it does on gloo), not die: it prints ``RAISED <error>`` and
exits 3. Usage: torch_ddp_kill.py [--shm 0|1]."""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ferrogrpc  # noqa: F401 - registers the "ferrogrpc" backend

VICTIM = 1
KILL_STEP = 2


def main() -> int:
    dist.init_process_group("ferrogrpc")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))
    # Small buckets: several all_reduces in flight while backward goes on.
    model = DistributedDataParallel(net, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank))
    steps = [0]  # the step running now

    def kill_midway(grad: torch.Tensor) -> torch.Tensor:
        if rank == VICTIM and steps[0] == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    # The first layer's gradient comes last: later buckets are on the wire.
    net[0].weight.register_hook(kill_midway)
    try:
        for step in range(5):
            steps[0] = step
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    except Exception as exc:  # what torch raised from our failed future
        print(f"RAISED {type(exc).__name__}: {exc}", flush=True)
        return 3
    print("NO ERROR", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
