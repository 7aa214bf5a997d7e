"""Where a small collective's time goes: wall time and CPU time per call,
per thread, of back-to-back 4 B all_reduces (or barriers), on rank 0.

    python scripts/small_cpu.py --world 2            # same host: direct sockets
    python scripts/small_cpu.py --world 2 --grpc     # every byte over gRPC
    python scripts/small_cpu.py --world 4 --op barrier

CPU time comes from /proc/self/task/*/stat (utime + stime, in clock ticks),
read before and after the timed calls; only threads that used any show.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _cpu_by_thread() -> dict[tuple[str, str], int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended
        out[(tid, name)] = int(fields[11]) + int(fields[12])
    return out


def worker(args: argparse.Namespace) -> None:
    import torch

    import ferrogrpc as fg

    torch.set_num_threads(1)
    backend = fg.init_backend(shm=not args.grpc)
    t = torch.ones(1)

    def call() -> None:
        if args.op == "barrier":
            backend.barrier()
        else:
            backend.all_reduce(t)

    for _ in range(200):
        call()
    tick = os.sysconf("SC_CLK_TCK")
    before, w0, c0 = _cpu_by_thread(), time.perf_counter(), time.process_time()
    for _ in range(args.calls):
        call()
    w1, c1, after = time.perf_counter(), time.process_time(), _cpu_by_thread()
    if backend.rank == 0:
        n = args.calls
        print(
            f"{args.op} world {backend.world_size} path {backend.data_path}: "
            f"wall {(w1 - w0) / n * 1e6:.0f} us/call, CPU {(c1 - c0) / n * 1e6:.0f} us/call",
            flush=True,
        )
        for key, ticks in sorted(after.items()):
            used = ticks - before.get(key, 0)
            if used:
                print(f"  thread {key[1]}: {used / tick / n * 1e6:.0f} us/call", flush=True)
    backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--grpc", action="store_true", help="FERROGRPC_SHM=0: every byte over gRPC")
    parser.add_argument("--op", choices=("all_reduce", "barrier"), default="all_reduce")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    from ferrogrpc.launch import spawn_ranks

    argv = [sys.executable, __file__, *sys.argv[1:], "--worker"]
    procs = spawn_ranks(args.world, argv, capture=False)
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
