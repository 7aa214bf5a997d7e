"""Collectives on N peers in one event loop, over both transports, against a
float64 reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc import collectives
from tests.conformance import check_all_reduce, run_conformance
from tests.helpers import reference_sum

pytestmark = pytest.mark.timeout(120)

ALL_DTYPES = list(fg.SUPPORTED_DTYPES)
SMALL = fg.ChunkPolicy(chunk_bytes=64, max_lanes=3, lane_min_bytes=256)


@pytest.mark.parametrize("transport", ["memory", "grpc"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
async def test_conformance_every_dtype_and_shape(transport: str, world: int) -> None:
    # Tiny chunks and lanes, so that even small tensors take many chunks,
    # several lanes and uneven segments.
    async with fg.testing.local_group(world, transport=transport, chunk_policy=SMALL) as peers:  # type: ignore[arg-type]
        await run_conformance(peers, ALL_DTYPES)


@pytest.mark.parametrize(
    ("held", "held_bytes"), [(0, 1 << 40), (1, 1 << 40), (10_000, 1 << 40), (10_000, 100)]
)
@pytest.mark.parametrize("world", [3, 5])
async def test_conformance_whether_or_not_forwards_are_held(
    held: int, held_bytes: int, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lane keeps up to HELD_MESSAGES forwarded messages, and HELD_BYTES
    # (one message at least), ready for its sender and writes the rest to
    # the tensor; both paths, and their mix, give the same results.
    monkeypatch.setattr(collectives, "HELD_MESSAGES", held)
    monkeypatch.setattr(collectives, "HELD_BYTES", held_bytes)
    async with fg.testing.local_group(world, chunk_policy=SMALL) as peers:
        await run_conformance(peers, ALL_DTYPES)


@pytest.mark.parametrize("world", [2, 3])
async def test_large_float64_all_reduce_default_policy(world: int) -> None:
    async with fg.testing.local_group(world) as peers:
        gen = torch.Generator().manual_seed(7)
        inputs = [torch.randn(3_000_001, generator=gen, dtype=torch.float64) for _ in range(world)]
        tensors = [t.clone() for t in inputs]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
        ref = reference_sum(inputs)
        for t in tensors:
            torch.testing.assert_close(t, ref, atol=1e-12, rtol=1e-12)


async def test_sixteen_concurrent_all_reduces_on_four_ranks() -> None:
    sizes = [
        0,
        1,
        3,
        17,
        100,
        1000,
        4097,
        10_000,
        65_536,
        100_003,
        262_144,
        7,
        2,
        555,
        31_337,
        1 << 20,
    ]
    async with fg.testing.local_group(4) as peers:
        inputs = [
            [
                torch.randn(n, generator=torch.Generator().manual_seed(r * 100 + i))
                for i, n in enumerate(sizes)
            ]
            for r in range(4)
        ]
        tensors = [[t.clone() for t in row] for row in inputs]
        # Every rank launches all 16 before awaiting any.
        await asyncio.gather(*(peers[r].all_reduce(t) for r in range(4) for t in tensors[r]))
        for i in range(len(sizes)):
            ref = reference_sum([inputs[r][i] for r in range(4)])
            for r in range(4):
                torch.testing.assert_close(tensors[r][i].double(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("transport", ["memory", "grpc"])
async def test_non_contiguous_tensor_is_reduced_in_place(transport: str) -> None:
    async with fg.testing.local_group(2, transport=transport) as peers:  # type: ignore[arg-type]
        bases = [torch.arange(12.0).reshape(3, 4) * (r + 1) for r in range(2)]
        views = [b.t() for b in bases]
        assert not views[0].is_contiguous()
        await asyncio.gather(*(p.all_reduce(v) for p, v in zip(peers, views, strict=True)))
        for b in bases:
            torch.testing.assert_close(b, torch.arange(12.0).reshape(3, 4) * 3)


async def test_string_ops_and_mean_on_integers_rejected() -> None:
    async with fg.testing.local_group(2, transport="memory") as peers:
        await check_all_reduce(peers, (4,), torch.float32, "MAX".lower(), 1)
        with pytest.raises(fg.ConfigError, match="MEAN is not defined"):
            peers[0].all_reduce(torch.ones(2, dtype=torch.int32), fg.ReduceOp.MEAN)
        with pytest.raises(fg.ConfigError, match="unknown reduce op"):
            peers[0].all_reduce(torch.ones(2), "product")
