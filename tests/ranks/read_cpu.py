"""A rank program for gRPC's read tuning (transport/grpc_tuning.py): after
a warm-up, all_reduces of N float32 ones over a slow link, each timed in
this process's CPU and in its voluntary context switches (every thread:
gRPC's too; a switch is a thread that blocked, so each of the reader's
wake-ups counts one). Prints one JSON line: the CPU seconds and the
switches per call, whether each sum was exact, and the tuning's state."""

from __future__ import annotations

import json
import os
import resource

import torch

import ferrogrpc as fg
from ferrogrpc.transport import grpc_tuning


def _usage() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_nvcsw


def main() -> int:
    torch.set_num_threads(1)
    n, calls = int(os.environ["ELEMENTS"]), int(os.environ["CALLS"])
    with fg.init_backend() as backend:
        backend.all_reduce(torch.ones(4))  # every connection is up
        cpu, wakeups, exact = [], [], []
        for _ in range(calls):
            t = torch.ones(n)
            backend.barrier()
            cpu_before, switches_before = _usage()
            backend.all_reduce(t)
            cpu_after, switches_after = _usage()
            cpu.append(cpu_after - cpu_before)
            wakeups.append(switches_after - switches_before)
            exact.append(bool((t == backend.world_size).all()))
        record = {"rank": backend.rank, "cpu_s": cpu, "wakeups": wakeups, "exact": exact}
    print(json.dumps(record | {"tuning": grpc_tuning.state()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
