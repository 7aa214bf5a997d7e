"""ferrogrpc's own CPU cost per all_reduce, without gRPC: the same ring
(reductions, checksums, framing, the asyncio driver) over the in-memory
transport, all ranks in one thread, so the process CPU time divided by the
world size is one rank's own work. Set against a real run's CPU time per
rank, the rest is the gRPC transport's.

    python scripts/own_cost.py --world-size 4 --mib 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ferrogrpc as fg


async def own_cost(world: int, numel: int, checksum: bool, iters: int) -> float:
    """Median CPU milliseconds per rank per all_reduce."""
    # The chunking a gRPC group of this size uses.
    chunk_bytes, lanes = fg.ChunkPolicy().resolve(world)
    policy = fg.ChunkPolicy(chunk_bytes=chunk_bytes, max_lanes=lanes)
    async with fg.testing.local_group(
        world, transport="memory", chunk_policy=policy, checksum=checksum
    ) as peers:
        tensors = [torch.ones(numel) for _ in range(world)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
        costs = []
        for _ in range(iters):
            cpu = time.process_time()
            await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
            costs.append((time.process_time() - cpu) / world * 1e3)
        expected = float(world ** (iters + 1))
        assert all(bool(t.eq(expected).all()) for t in tensors)
        return statistics.median(costs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--iters", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = args.mib * (1 << 20) // 4
    for checksum in (True, False):
        ms = asyncio.run(own_cost(args.world_size, numel, checksum, args.iters))
        print(
            f"own CPU per rank, {args.mib} MiB all_reduce, world {args.world_size}, "
            f"checksum {'on' if checksum else 'off'}: {ms:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
