"""A rank program for gRPC's read tuning (transport/grpc_tuning.py): after
a warm-up, all_reduces of N float32 ones over a slow link, each timed in
this process's CPU (every thread: gRPC's too). Prints one JSON line: the
CPU seconds per call, whether each sum was exact, and the tuning's state."""

from __future__ import annotations

import json
import os
import resource

import torch

import ferrogrpc as fg
from ferrogrpc.transport import grpc_tuning


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    torch.set_num_threads(1)
    n, calls = int(os.environ["ELEMENTS"]), int(os.environ["CALLS"])
    with fg.init_backend() as backend:
        backend.all_reduce(torch.ones(4))  # every connection is up
        cpu, exact = [], []
        for _ in range(calls):
            t = torch.ones(n)
            backend.barrier()
            before = _cpu_s()
            backend.all_reduce(t)
            cpu.append(_cpu_s() - before)
            exact.append(bool((t == backend.world_size).all()))
        record = {"rank": backend.rank, "cpu_s": cpu, "exact": exact}
    print(json.dumps(record | {"tuning": grpc_tuning.state()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
