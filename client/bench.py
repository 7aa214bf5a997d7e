"""Collective benchmark: ferrogrpc against torch.distributed's gloo, same run.

Prints an nccl-tests style table per world size: size, then time and busbw
for gloo and for ferrogrpc's two data paths, each as a ratio to gloo: the
same-host path (shared memory, the default when ranks share a host) and the
gRPC path (``FERROGRPC_SHM=0``), the latter with its chunk checksum on (the
default) and off. Then each rank's peak extra RSS during its first
ferrogrpc collectives at that size, as a fraction of the tensor size
(measured first, largest size first, so the largest size's figure is that of
a process that has run no ferrogrpc collective yet); for the same-host path
the shared segments count divided among the ranks that map them. The
implementations take turns, one iteration each, in an order that rotates,
so that the shared machine's slow and fast spells fall on all of them alike.
Every result is checked whole against the exact expected value (``ok``).

    python -m client.bench --world-sizes 2 4 --min-size 1M --max-size 256M --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

from client.common import MiB, collect, fmt_size, measure, parse_size
from client.forks import spawn_ranks
from ferrogrpc.testing import free_port

SHM = "shm"
GRPC = "grpc"
NO_CRC = "grpc-nocrc"
IMPLS = ("gloo", SHM, GRPC, NO_CRC)


def result_ok(t: Any, expected: float) -> bool:
    """Whether every element of the tensor ``t`` equals ``expected``: the ok
    column checks the whole result, not a sample of it."""
    return bool(t.eq(expected).all())


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
    # Two ferrogrpc groups: the default (same-host plane on) and every byte
    # over gRPC; each its own backend, rendezvous and loop thread.
    backends = {
        SHM: fg.init_backend(checksum=not args.no_checksum),
        GRPC: fg.init_backend(checksum=not args.no_checksum, shm=False, master_port=args.grpc_port),
    }
    crc = fg.testing.checksum(backends[GRPC])
    # Memory first, alone, largest size first: the largest size's figure is
    # then that of a process that has run no such collective yet (gloo's
    # set-up has run), so it includes every buffer the first call grows
    # (later calls reuse them). The heap is shared, so no other
    # implementation runs before or during this.
    rss_extra: dict[str, dict[int, int]] = {SHM: {}, GRPC: {}}
    rss_ok: dict[int, bool] = {}
    calls = args.warmup + 1
    for path in (SHM, GRPC):
        backend = backends[path]
        for size in sorted(args.sizes, reverse=True):
            t = torch.ones(size // 4, dtype=torch.float32)

            def first_calls(t: torch.Tensor = t, backend: fg.Backend = backend) -> None:
                for _ in range(calls):
                    backend.all_reduce(t)

            dist.barrier()
            base, shared = fg.testing.rss(), _rss_shmem()
            peak = fg.testing.peak_rss(first_calls) - base
            # Shared segments are mapped by every rank of the host: count
            # this rank's share of them.
            mapped = _rss_shmem() - shared
            rss_extra[path][size] = peak - mapped + mapped // world
            rss_ok[size] = rss_ok.get(size, True) and result_ok(t, float(world**calls))
            del first_calls, t
    rows = []
    for size in args.sizes:
        numel = size // 4
        tensors = {impl: torch.ones(numel, dtype=torch.float32) for impl in IMPLS}

        def gloo_op(t: torch.Tensor = tensors["gloo"]) -> None:
            dist.all_reduce(t)

        def fg_op(impl: str, t: torch.Tensor) -> Callable[[], None]:
            backend = backends[SHM if impl == SHM else GRPC]
            checksum = None if impl == NO_CRC else crc

            def op() -> None:
                if impl != SHM:
                    # Every rank switches between the same collectives, in turn.
                    fg.testing.set_checksum(backend, checksum)
                backend.all_reduce(t)

            return op

        ops = {"gloo": gloo_op, **{impl: fg_op(impl, tensors[impl]) for impl in IMPLS[1:]}}
        times = measure(ops, dist.barrier, args.iters, args.warmup)
        calls_made = args.iters + args.warmup
        result: dict[str, Any] = {
            "size": size,
            "rss_shm": rss_extra[SHM][size],
            "rss_grpc": rss_extra[GRPC][size],
        }
        expected = float(world**calls_made)
        for impl in IMPLS:
            # The whole result, every element, exactly.
            ok = result_ok(tensors[impl], expected)
            if impl != "gloo":
                ok = ok and rss_ok[size]
            result[impl] = {"times": times[impl], "ok": ok}
        del tensors
        rows.append(result)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    for backend in backends.values():
        backend.close()
    dist.destroy_process_group()


def _rss_shmem() -> int:
    """Resident shared-memory bytes of this process (RssShmem)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


def run_world(world: int, args: argparse.Namespace) -> list[Any]:
    cmd = [sys.executable, "-m", "client.bench", "--worker", "--gloo-port", str(free_port())]
    cmd += ["--grpc-port", str(free_port())]
    cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup)]
    cmd += ["--sizes", *[str(s) for s in args.sizes]]
    if args.no_checksum:
        cmd.append("--no-checksum")
    return list(collect(spawn_ranks(world, cmd, OMP_NUM_THREADS="1"), args.timeout, "bench"))


def report(world: int, per_rank: list[list[dict[str, Any]]]) -> str:
    factor = 2.0 * (world - 1) / world
    iters = len(per_rank[0][0]["gloo"]["times"])
    lines = [
        f"# all_reduce float32, world_size {world}, median of {iters} interleaved iterations "
        "(time = slowest rank); busbw in GB/s; x = busbw / gloo's; shm: same-host path "
        "(default), grpc: FERROGRPC_SHM=0, checksum on (default) and off",
        f"{'size':>8} {'gloo ms':>8} {'busbw':>6} | {'shm ms':>8} {'busbw':>6} {'x':>5} | "
        f"{'grpc ms':>8} {'busbw':>6} {'x':>5} | {'nocrc':>6} {'x':>5} | "
        f"{'RSS/size shm':>12} {'grpc':>5} {'ok':>3}",
    ]
    for i, row in enumerate(per_rank[0]):
        size = row["size"]
        med = {}
        for impl in IMPLS:
            slowest = [max(r[i][impl]["times"][k] for r in per_rank) for k in range(iters)]
            med[impl] = statistics.median(slowest)
        rss_shm = max(r[i]["rss_shm"] for r in per_rank) / size
        rss_grpc = max(r[i]["rss_grpc"] for r in per_rank) / size
        ok = all(r[i][impl]["ok"] for r in per_rank for impl in IMPLS)
        bus = {impl: size / med[impl] * factor / 1e9 for impl in IMPLS}
        lines.append(
            f"{fmt_size(size):>8} {med['gloo'] * 1e3:8.2f} {bus['gloo']:6.3f} | "
            f"{med[SHM] * 1e3:8.2f} {bus[SHM]:6.3f} {bus[SHM] / bus['gloo']:5.2f} | "
            f"{med[GRPC] * 1e3:8.2f} {bus[GRPC]:6.3f} {bus[GRPC] / bus['gloo']:5.2f} | "
            f"{bus[NO_CRC]:6.3f} {bus[NO_CRC] / bus['gloo']:5.2f} | "
            f"{rss_shm:12.3f} {rss_grpc:5.3f} {'yes' if ok else 'NO':>3}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--latency" in argv:
        from client.bench_latency import main as latency_main

        argv.remove("--latency")
        return latency_main(argv)
    if "--elastic" in argv:
        # A lost member and a joiner: recovery, admission, state transfer.
        from client.bench_elastic import main as elastic_main

        argv.remove("--elastic")
        return elastic_main(argv)
    if any(arg == "--link" or arg.startswith("--link=") for arg in argv):
        # gloo and ferrogrpc on rate-limited links, one rank per network
        # namespace.
        from client.bench_link import main as link_main

        return link_main(argv)
    if "--torch" in argv:
        # torch's DDP on gloo and on ferrogrpc (and ferrogrpc's own DDP),
        # same model, same run.
        from client.bench_train import main as train_main

        argv.remove("--torch")
        return train_main(["--wrapper", "ddp", *argv])
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
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="instead: a lost member and a joiner in an elastic group (client.bench_elastic)",
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="instead: small collectives' latency against gloo (client.bench_latency)",
    )
    parser.add_argument(
        "--torch",
        action="store_true",
        help="instead: torch DDP on gloo and on ferrogrpc, same model (client.bench_train)",
    )
    parser.add_argument(
        "--link",
        nargs="*",
        metavar="RATE[,RTT]",
        help="instead: gloo and ferrogrpc on rate-limited links, one rank per network namespace "
        "(client.bench_link; root)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
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
