"""A/B of chunk sizes for all_reduce over gRPC, in one run: one backend
(its own group) per chunk size, every size timed in turn in every
iteration (the order reversed every other one), so that the machine's slow
and fast spells fall on all of them alike. Each result is checked.

    python scripts/chunk_ab.py --world 2 --chunks-mib 1 2 4 --sizes-mib 1 4 16 64 256

Prints rank 0's median time per tensor size and chunk size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def worker(args: argparse.Namespace) -> None:
    import torch

    import ferrogrpc as fg

    torch.set_num_threads(1)
    ports = [int(p) for p in os.environ["CHUNK_AB_PORTS"].split(",")]
    backends = {
        mib: fg.init_backend(
            shm=False, master_port=port, chunk_policy=fg.ChunkPolicy(chunk_bytes=mib << 20)
        )
        for mib, port in zip(args.chunks_mib, ports, strict=True)
    }
    first = next(iter(backends.values()))
    world = first.world_size
    times: dict[tuple[int, int], list[float]] = {}
    for size in args.sizes_mib:
        x = torch.ones(size << 18)
        for backend in backends.values():
            backend.all_reduce(x.clone())  # warm-up
        for it in range(args.iters):
            order = list(backends) if it % 2 == 0 else list(backends)[::-1]
            for chunk in order:
                t = x.clone()
                first.barrier()
                start = time.perf_counter()
                backends[chunk].all_reduce(t)
                times.setdefault((size, chunk), []).append(time.perf_counter() - start)
                if not bool(t.eq(float(world)).all()):
                    raise SystemExit(f"wrong result: {size} MiB in {chunk} MiB chunks")
    if first.rank == 0:
        print(f"# all_reduce over gRPC, world {world}, median of {args.iters}, rank 0, ms")
        for size in args.sizes_mib:
            cells = [
                f"{c} MiB chunks {statistics.median(times[(size, c)]) * 1e3:7.1f}" for c in backends
            ]
            print(f"{size:4d} MiB: " + "  ".join(cells), flush=True)
    for backend in backends.values():
        backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--chunks-mib", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.world < 2 or args.iters < 1:
        parser.error("--world must be at least 2 and --iters at least 1")
    if any(not 1 <= c <= 64 for c in args.chunks_mib) or len(set(args.chunks_mib)) < 2:
        parser.error("--chunks-mib takes at least two different sizes, each 1 to 64")
    if any(s < 1 for s in args.sizes_mib):
        parser.error("--sizes-mib must be at least 1")
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ferrogrpc.testing import free_port, spawn_ranks

    os.environ["CHUNK_AB_PORTS"] = ",".join(str(free_port()) for _ in args.chunks_mib)
    argv = [sys.executable, __file__, *sys.argv[1:], "--worker"]
    procs = spawn_ranks(args.world, argv, capture=False)
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
