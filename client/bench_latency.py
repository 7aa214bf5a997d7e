"""Latency benchmark: small collectives against gloo, same run
(``ferrogrpc bench --latency``).

For all_reduce and all_gather from 4 B to 1 MiB, and barrier: the median
time over interleaved iterations (the slowest rank's), for gloo, ferrogrpc's
same-host path (shared memory, the default on one machine) and its gRPC
path (``FERROGRPC_SHM=0``: small collectives on the TCP mesh), and that
path with ``FERROGRPC_DIRECT=0`` (small collectives over gRPC itself), each
as a ratio to gloo's. Then a bandwidth
line: a 64 MiB float32 all_reduce over gRPC with ``wire_dtype=bfloat16``
against float32. Every result is checked whole, untimed: the input is set
before each call's barrier and checked after its clock stops.

How a call starts (``--start``), each timed on every rank and the slowest
rank's time kept:

- ``own`` (the default): each implementation's call follows its own
  barrier, and each rank is timed from its own start, as osu_allreduce
  times MPI's: a collective after the same library's last one.
- ``gloo``: every implementation's call follows a gloo barrier. Its uneven
  exit leaves the ranks in the order of gloo's ring, which suits gloo's
  next collective and not an exchange among all ranks.
- ``clock``: every rank sleeps until one agreed instant (10 ms after rank 0
  leaves a gloo barrier, broadcast to all; one host's processes share
  ``time.monotonic``'s clock) and is timed from it: a simultaneous start,
  from idle, which adds the machine's wake-up latency to every time.

    python -m client.bench_latency --world-sizes 2 4 --iters 41
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from client.common import collect, fmt_size, measure, parse_size
from client.forks import spawn_ranks
from ferrogrpc.testing import free_port

# gloo; ferrogrpc on one host (shared memory and Unix direct sockets); with
# one rank per host (FERROGRPC_SHM=0): small collectives on the TCP mesh
# ("grpc", the default), and over gRPC itself ("grpc0": FERROGRPC_DIRECT=0).
IMPLS = ("gloo", "shm", "grpc", "grpc0")
SIZES = ["4", "64", "1K", "16K", "64K", "256K", "1M"]
WIRE_BYTES = 64 << 20
_Ops = dict[str, Callable[[], Any]]
# How far ahead of rank 0's barrier exit the agreed start of a call lies
# (--start clock): past the other ranks' exits and the broadcast of it.
START_LEAD_S = 0.01
START_WORDS = {
    "own": "each call after its own implementation's barrier",
    "gloo": "each call after a gloo barrier",
    "clock": "all ranks start at one agreed instant",
}


def _set_timer_slack_ns(ns: int) -> None:
    """prctl(PR_SET_TIMERSLACK): how late the kernel may end this thread's sleeps."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(29, ctypes.c_ulong(ns), 0, 0, 0)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ferrogrpc as fg

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=rank, world_size=world
    )
    backends = {
        "shm": fg.init_backend(),
        "grpc": fg.init_backend(shm=False, master_port=args.grpc_port),
    }
    os.environ["FERROGRPC_DIRECT"] = "0"  # read by the next init_backend only
    backends["grpc0"] = fg.init_backend(shm=False, master_port=args.grpc0_port)
    del os.environ["FERROGRPC_DIRECT"]
    rows: list[dict[str, Any]] = []
    checks: list[bool] = []
    late = [0]  # calls that began after their agreed start (see clock_start)
    # Sleeps end within a microsecond or so of their deadline, not 50 us
    # after it (the default timer slack), on every rank alike.
    _set_timer_slack_ns(1)

    def clock_start() -> float:
        """Every rank starts at one agreed instant, START_LEAD_S after rank 0
        leaves a barrier, sleeping until then."""
        dist.barrier()
        at = torch.tensor([time.monotonic() + START_LEAD_S], dtype=torch.float64)
        dist.broadcast(at, 0)
        began = float(at.item())
        wait = began - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        else:
            late[0] += 1
        return began

    start = clock_start if args.start == "clock" else None
    barriers: _Ops = {}
    if args.start == "own":
        barriers = {impl: partial(backends[impl].barrier) for impl in IMPLS[1:]}

    def ops_for(op: str, size: int) -> tuple[_Ops, _Ops, _Ops]:
        """The timed calls, and what runs untimed before (the input) and
        after (the check of the whole result) each of them."""
        n = max(1, size // 4)
        if op == "barrier":
            return (
                {
                    "gloo": dist.barrier,
                    "shm": backends["shm"].barrier,
                    "grpc": backends["grpc"].barrier,
                    "grpc0": backends["grpc0"].barrier,
                },
                {},
                {},
            )
        t = {impl: torch.full((n,), float(rank + 1)) for impl in IMPLS}
        if op == "all_reduce":
            expected = float(world * (world + 1) // 2)

            def reduce(impl: str) -> Callable[[], Any]:
                if impl == "gloo":
                    return lambda: dist.all_reduce(t[impl])
                return lambda: backends[impl].all_reduce(t[impl])

            return (
                {impl: reduce(impl) for impl in IMPLS},
                {impl: partial(t[impl].fill_, float(rank + 1)) for impl in IMPLS},
                {impl: partial(check, t[impl], expected) for impl in IMPLS},
            )
        out = {impl: torch.empty(world * n) for impl in IMPLS}
        reference = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n)

        def gather(impl: str) -> Callable[[], Any]:
            if impl == "gloo":
                return lambda: dist.all_gather_into_tensor(out[impl], t[impl])
            return lambda: backends[impl].all_gather_into_tensor(out[impl], t[impl])

        return (
            {impl: gather(impl) for impl in IMPLS},
            {impl: partial(out[impl].fill_, -1.0) for impl in IMPLS},
            {impl: partial(check, out[impl], reference) for impl in IMPLS},
        )

    def check(t: torch.Tensor, expected: float | torch.Tensor) -> None:
        checks.append(bool(t.eq(expected).all()))

    cases = [("all_reduce", s) for s in args.sizes] + [("all_gather", s) for s in args.sizes]
    cases.append(("barrier", 0))
    for op, size in cases:
        ops, before, after = ops_for(op, size)
        times = measure(ops, dist.barrier, args.iters, args.warmup, before, after, start, barriers)
        rows.append({"op": op, "size": size, "times": times})
    # Bandwidth with a wire dtype, over gRPC.
    grpc = backends["grpc"]
    big = {w: torch.ones(WIRE_BYTES // 4) for w in ("float32", "bfloat16")}
    wires = {"float32": None, "bfloat16": torch.bfloat16}
    wire_times: dict[str, list[float]] = {w: [] for w in big}
    if args.wire_iters:
        wire_times = measure(
            {w: partial(grpc.all_reduce, big[w], wire_dtype=wires[w]) for w in big},
            dist.barrier,
            args.wire_iters,
            1,
            {w: partial(big[w].fill_, 1.0) for w in big},
            {w: partial(check, big[w], float(world)) for w in big},
        )
    result = {"rows": rows, "wire": wire_times, "ok": all(checks), "late": late[0]}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    for b in backends.values():
        b.close()
    dist.destroy_process_group()


def _size(n: int) -> str:
    return fmt_size(n) if n >= 1024 else f"{n} B"


def report(world: int, per_rank: list[dict[str, Any]], start: str = "own") -> str:
    iters = len(per_rank[0]["rows"][0]["times"]["gloo"])
    lines = [
        f"# latency, world_size {world}, median of {iters} interleaved iterations "
        f"(time = slowest rank, {START_WORDS[start]}), ms; x = time / gloo's",
        f"{'op':>10} {'size':>8} {'gloo':>8} | {'shm':>8} {'x':>6} | {'grpc':>8} {'x':>6}"
        f" | {'grpc0':>8} {'x':>6}",
    ]
    for i, row in enumerate(per_rank[0]["rows"]):
        med = {}
        for impl in IMPLS:
            slowest = [max(r["rows"][i]["times"][impl][k] for r in per_rank) for k in range(iters)]
            med[impl] = statistics.median(slowest) * 1e3
        size = (
            ""
            if row["op"] == "barrier"
            else fmt_size(row["size"])
            if row["size"] >= 1024
            else f"{row['size']} B"
        )
        lines.append(
            f"{row['op']:>10} {size:>8} {med['gloo']:8.3f} | {med['shm']:8.3f} "
            f"{med['shm'] / med['gloo']:6.2f} | {med['grpc']:8.3f} {med['grpc'] / med['gloo']:6.2f}"
            f" | {med['grpc0']:8.3f} {med['grpc0'] / med['gloo']:6.2f}"
        )
    if per_rank[0]["wire"]["float32"]:  # else --wire-iters 0
        wire = {}
        for name in ("float32", "bfloat16"):
            count = len(per_rank[0]["wire"][name])
            wire[name] = statistics.median(
                max(r["wire"][name][k] for r in per_rank) for k in range(count)
            )
        lines.append(
            f"# all_reduce 64 MiB float32 over gRPC: float32 {wire['float32'] * 1e3:.1f} ms, "
            f"wire_dtype=bfloat16 {wire['bfloat16'] * 1e3:.1f} ms "
            f"({wire['bfloat16'] / wire['float32']:.2f} x)"
        )
    late = sum(r["late"] for r in per_rank)
    if late:
        lines.append(f"# {late} calls on some rank began after the agreed start (counted from it)")
    # Every call's whole result, on every rank.
    lines.append(f"# results {'ok' if all(r['ok'] for r in per_rank) else 'WRONG'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--sizes", type=parse_size, nargs="+", default=[parse_size(s) for s in SIZES]
    )
    parser.add_argument("--iters", type=int, default=41)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--wire-iters", type=int, default=7)
    parser.add_argument(
        "--start",
        choices=tuple(START_WORDS),
        default="own",
        help="own: each call follows its own implementation's barrier (default); gloo: every "
        "call follows a gloo barrier; clock: all ranks start each call at one agreed instant, "
        "timed from it (see the module docstring)",
    )
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc0-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.iters, args.warmup, args.wire_iters) < 0 or args.iters == 0:
        parser.error("--iters must be at least 1; --warmup and --wire-iters at least 0")
    if args.worker:
        worker(args)
        return 0
    print(f"ferrogrpc bench --latency: {os.cpu_count()} CPUs", flush=True)
    failed = False
    for world in args.world_sizes:
        cmd = [sys.executable, "-m", "client.bench_latency", "--worker"]
        cmd += ["--gloo-port", str(free_port()), "--grpc-port", str(free_port())]
        cmd += ["--grpc0-port", str(free_port())]
        cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup)]
        cmd += ["--wire-iters", str(args.wire_iters), "--sizes", *map(str, args.sizes)]
        cmd += ["--start", args.start]
        per_rank = collect(spawn_ranks(world, cmd, OMP_NUM_THREADS="1"), args.timeout, "latency")
        text = report(world, list(per_rank), args.start)
        print(text, flush=True)
        failed |= "WRONG" in text
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
