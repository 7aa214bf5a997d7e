"""Where a small collective's time goes: wall time and CPU time per call,
per thread, of back-to-back 4 B all_reduces (or barriers), on rank 0.

    python scripts/small_cpu.py --world 2            # same host: direct sockets
    python scripts/small_cpu.py --world 2 --grpc     # every byte over gRPC
    python scripts/small_cpu.py --world 4 --op barrier
    python scripts/small_cpu.py --world 2 --grpc --gap-ms 2   # each call after a 2 ms sleep
    python scripts/small_cpu.py --world 4 --gloo             # the same loop on torch's gloo

With ``--gap-ms`` every call starts after a sleep, when this rank's threads
have gone to sleep (as in the bench, where each call follows a gloo
barrier), and rank 0 also prints the median call, the sleeps excluded.

CPU time comes from /proc/self/task/*/stat (utime + stime, in clock ticks),
read before and after the timed calls; only threads that used any show.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable


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
    t = torch.ones(1)
    barrier: Callable[[], object]
    all_reduce: Callable[[torch.Tensor], object]
    if args.gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # MASTER_ADDR/PORT from the launcher
        rank, world, path = dist.get_rank(), dist.get_world_size(), "gloo"
        barrier, all_reduce = dist.barrier, dist.all_reduce
    else:
        backend = fg.init_backend(shm=not args.grpc)
        rank, world, path = backend.rank, backend.world_size, backend.data_path
        barrier, all_reduce = backend.barrier, backend.all_reduce

    def call() -> None:
        if args.op == "barrier":
            barrier()
        else:
            all_reduce(t)

    for _ in range(200):
        call()
    tick = os.sysconf("SC_CLK_TCK")
    gap = args.gap_ms / 1e3
    times = []
    before, w0, c0 = _cpu_by_thread(), time.perf_counter(), time.process_time()
    for _ in range(args.calls):
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    w1, c1, after = time.perf_counter(), time.process_time(), _cpu_by_thread()
    if gap:
        w1 = w0 + sum(times)
    if rank == 0:
        n = args.calls
        print(
            f"{args.op} world {world} path {path}: "
            f"wall {(w1 - w0) / n * 1e6:.0f} us/call, CPU {(c1 - c0) / n * 1e6:.0f} us/call"
            + (
                f", median {sorted(times)[n // 2] * 1e6:.0f} us {args.gap_ms:g} ms apart"
                if gap
                else ""
            ),
            flush=True,
        )
        for key, ticks in sorted(after.items()):
            used = ticks - before.get(key, 0)
            if used:
                print(f"  thread {key[1]}: {used / tick / n * 1e6:.0f} us/call", flush=True)
    if args.gloo:
        dist.destroy_process_group()
    else:
        backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--grpc", action="store_true", help="FERROGRPC_SHM=0: every byte over gRPC")
    parser.add_argument("--gloo", action="store_true", help="the same loop on torch's gloo")
    parser.add_argument("--op", choices=("all_reduce", "barrier"), default="all_reduce")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--gap-ms", type=float, default=0.0, help="sleep before every call")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calls < 1 or args.gap_ms < 0:
        parser.error("--calls must be at least 1 and --gap-ms not negative")
    if args.worker:
        worker(args)
        return 0
    from ferrogrpc.testing import spawn_ranks

    argv = [sys.executable, __file__, *sys.argv[1:], "--worker"]
    procs = spawn_ranks(args.world, argv, capture=False)
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
