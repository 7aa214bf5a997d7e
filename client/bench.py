"""Collective benchmark: ferrogrpc against torch.distributed's gloo, same run.

Prints an nccl-tests style table per world size: size, time, algbw, busbw for
both, the ferrogrpc/gloo busbw ratio, and each rank's peak extra RSS during
the ferrogrpc collective as a fraction of the tensor size (measured first,
largest size first, so the largest size's figure is that of a process that
has run no ferrogrpc collective yet). The
implementations take turns, one iteration each, so that the shared machine's
slow and fast spells fall on all of them alike.

    python -m client.bench --world-sizes 2 4 --min-size 1M --max-size 256M --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ferrogrpc.launch import free_port, spawn_ranks

MiB = 1 << 20
NO_CRC = "ferrogrpc-nocrc"
IMPLS = ("gloo", "ferrogrpc", NO_CRC)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def rotated(names: list[str], i: int) -> list[str]:
    """``names`` starting at position ``i`` (mod its length): round ``i`` of an
    interleaved comparison, so that no implementation always runs right after
    the same other one."""
    k = i % len(names)
    return names[k:] + names[:k]


def _measure(
    ops: dict[str, Callable[[], Any]],
    barrier: Callable[[], None],
    iters: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Times of every implementation, after ``warmup`` calls of each: one
    iteration of each in turn, so that the shared machine's slow and fast
    spells fall on all of them alike."""
    for fn in ops.values():
        barrier()
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for i in range(iters):
        # The order rotates every round, so that no implementation always
        # runs right after another one's call.
        for name in rotated(names, i):
            barrier()
            start = time.perf_counter()
            ops[name]()
            times[name].append(time.perf_counter() - start)
    return times


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ferrogrpc as fg

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.gloo_port}",
        rank=rank,
        world_size=world,
    )
    backend = fg.init_backend(checksum=not args.no_checksum)
    crc = backend.peer.checksum
    # Memory first, alone, largest size first: the largest size's figure is
    # then that of a process that has run no ferrogrpc collective yet
    # (gloo's set-up has run), so it includes every buffer the first call
    # grows (later calls reuse them). The heap is shared, so no other
    # implementation runs before or during this.
    rss_extra: dict[int, int] = {}
    rss_ok: dict[int, bool] = {}
    calls = args.warmup + 1
    for size in sorted(args.sizes, reverse=True):
        t = torch.ones(size // 4, dtype=torch.float32)

        def first_calls(t: torch.Tensor = t) -> None:
            for _ in range(calls):
                backend.all_reduce(t)

        dist.barrier()
        base = fg.testing.rss()
        rss_extra[size] = fg.testing.peak_rss(first_calls) - base
        rss_ok[size] = bool(t[0].item() == t[-1].item() == float(world**calls))
        del first_calls, t
    rows = []
    for size in args.sizes:
        numel = size // 4
        tensors = {impl: torch.ones(numel, dtype=torch.float32) for impl in IMPLS}

        def gloo_op(t: torch.Tensor = tensors["gloo"]) -> None:
            dist.all_reduce(t)

        def fg_op(impl: str, t: torch.Tensor) -> Callable[[], None]:
            checksum = None if impl == NO_CRC else crc

            def op() -> None:
                # Every rank switches between the same collectives, in turn.
                backend.peer.checksum = checksum
                backend.all_reduce(t)

            return op

        ops = {
            "gloo": gloo_op,
            "ferrogrpc": fg_op("ferrogrpc", tensors["ferrogrpc"]),
            NO_CRC: fg_op(NO_CRC, tensors[NO_CRC]),
        }
        times = _measure(ops, dist.barrier, args.iters, args.warmup)
        calls_made = args.iters + args.warmup
        result: dict[str, Any] = {"size": size, "rss_extra": rss_extra[size]}
        for impl in IMPLS:
            t = tensors[impl]
            expected = float(world**calls_made)
            ok = bool(t[0].item() == expected and t[-1].item() == expected)
            if impl == "ferrogrpc":
                ok = ok and rss_ok[size]
            result[impl] = {"times": times[impl], "ok": ok}
        del tensors
        rows.append(result)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    backend.close()
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> list[Any]:
    cmd = [sys.executable, "-m", "client.bench", "--worker", "--gloo-port", str(free_port())]
    cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup)]
    cmd += ["--sizes", *[str(s) for s in args.sizes]]
    if args.no_checksum:
        cmd.append("--no-checksum")
    return list(collect(spawn_ranks(world, cmd, OMP_NUM_THREADS="1"), args.timeout, "bench"))


def collect(procs: list[subprocess.Popen[str]], timeout: float, what: str) -> Any:
    """Wait for every rank; return the JSON that rank 0 printed after RESULT."""
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            raise SystemExit(f"{what} rank {rank} exited with {p.returncode}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{what}: rank 0 printed no result")


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"


def report(world: int, per_rank: list[list[dict[str, Any]]]) -> str:
    factor = 2.0 * (world - 1) / world
    iters = len(per_rank[0][0]["gloo"]["times"])
    lines = [
        f"# all_reduce float32, world_size {world}, median of {iters} interleaved iterations "
        "(time = slowest rank); ferrogrpc with its checksum (CRC-32) on (default) and off",
        f"{'size':>8} {'gloo ms':>8} {'gloo busbw':>10} {'fg ms':>8} {'fg algbw':>8} "
        f"{'fg busbw':>8} {'fg/gloo':>7} {'nocrc busbw':>11} {'nocrc/gloo':>10} "
        f"{'peak RSS/size':>13} {'ok':>3}",
    ]
    for i, row in enumerate(per_rank[0]):
        size = row["size"]
        med = {}
        for impl in IMPLS:
            slowest = [max(r[i][impl]["times"][k] for r in per_rank) for k in range(iters)]
            med[impl] = statistics.median(slowest)
        rss = max(r[i]["rss_extra"] for r in per_rank) / size
        ok = all(r[i][impl]["ok"] for r in per_rank for impl in IMPLS)
        bus = {impl: size / med[impl] * factor / 1e9 for impl in IMPLS}
        lines.append(
            f"{fmt_size(size):>8} {med['gloo'] * 1e3:8.2f} {bus['gloo']:5.3f} GB/s "
            f"{med['ferrogrpc'] * 1e3:8.2f} {size / med['ferrogrpc'] / 1e9:8.3f} "
            f"{bus['ferrogrpc']:8.3f} {bus['ferrogrpc'] / bus['gloo']:7.2f} "
            f"{bus[NO_CRC]:6.3f} GB/s {bus[NO_CRC] / bus['gloo']:10.2f} "
            f"{rss:13.3f} {'yes' if ok else 'NO':>3}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-size", type=parse_size, default=MiB)
    parser.add_argument("--max-size", type=parse_size, default=256 * MiB)
    parser.add_argument("--sizes", type=parse_size, nargs="+", help="explicit sizes (bytes)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-checksum", action="store_true", help="turn the chunk checksum off")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.sizes:
        sizes = []
        s = args.min_size
        while s <= args.max_size:
            sizes.append(s)
            s *= 4
        args.sizes = sizes
    if args.worker:
        worker(args)
        return 0
    print(
        f"ferrogrpc bench: all_reduce, sizes {', '.join(fmt_size(s) for s in args.sizes)}, "
        f"checksum {'off' if args.no_checksum else 'on'}, {os.cpu_count()} CPUs",
        flush=True,
    )
    failed = False
    for world in args.world_sizes:
        per_rank = run_world(world, args)
        text = report(world, per_rank)
        print(text, flush=True)
        failed |= " NO" in text
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
