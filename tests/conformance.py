"""A reusable conformance suite: every collective on a group of peers, checked
against float64 references, over awkward shapes and every supported dtype."""

from __future__ import annotations

import asyncio

import torch

import ferrogrpc as fg
from tests.helpers import reference_sum, tolerance

SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (3, 5), (19,), (2, 0, 3), (1031,)]


def make_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers, so that sums are exact in every dtype, bf16 included
    (non-negative for uint8; 0 or 1 for bool)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(dtype)
    low = 0 if dtype == torch.uint8 else -8
    return torch.randint(low, 9, shape, generator=gen).to(dtype)


# Narrow dtypes: a product of a few small values could overflow them, so
# they are checked with sum, max, min and bxor (bool with max and min).
NARROW = (torch.uint8, torch.int8, torch.int16, torch.bool)


async def check_all_reduce(
    peers: list[fg.Peer], shape: tuple[int, ...], dtype: torch.dtype, op: str, seed: int
) -> None:
    n = len(peers)
    inputs = [make_input(r, shape, dtype, seed) for r in range(n)]
    tensors = [t.clone() for t in inputs]
    results = await asyncio.gather(
        *(p.all_reduce(t, op) for p, t in zip(peers, tensors, strict=True))
    )
    stacked = torch.stack([t.to(torch.float64) for t in inputs]) if n else None
    assert stacked is not None
    if op == "sum":
        ref = reference_sum(inputs)
    elif op == "mean":
        ref = reference_sum(inputs) / n
    elif op == "max":
        ref = stacked.max(0).values
    elif op == "product":
        ref = stacked.prod(0)
    elif op == "bxor":
        ints = torch.stack(inputs)
        ref = ints[0].clone()
        for x in ints[1:]:
            ref ^= x
        ref = ref.to(torch.float64)
    else:
        ref = stacked.min(0).values
    for r, (res, t) in enumerate(zip(results, tensors, strict=True)):
        assert res is t, "all_reduce must return its argument"
        assert t.shape == torch.Size(shape) and t.dtype == dtype
        torch.testing.assert_close(
            t.to(torch.float64), ref, **tolerance(dtype), msg=f"rank {r} {op} {dtype} {shape}"
        )
    # Every rank holds bitwise the same result.
    for t in tensors[1:]:
        assert torch.equal(t, tensors[0])


async def check_all_gather(
    peers: list[fg.Peer], shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> None:
    n = len(peers)
    inputs = [make_input(r, shape, dtype, seed) for r in range(n)]
    lists = await asyncio.gather(*(p.all_gather(t) for p, t in zip(peers, inputs, strict=True)))
    for got in lists:
        assert len(got) == n
        for r in range(n):
            assert got[r].shape == torch.Size(shape)
            assert torch.equal(got[r], inputs[r])
    outs = [torch.full((n * inputs[0].numel(),), 99, dtype=dtype) for _ in range(n)]
    await asyncio.gather(
        *(p.all_gather_into_tensor(o, t) for p, o, t in zip(peers, outs, inputs, strict=True))
    )
    expected = torch.cat([t.reshape(-1) for t in inputs])
    for o in outs:
        assert torch.equal(o, expected)


async def check_reduce_scatter(
    peers: list[fg.Peer], shape: tuple[int, ...], dtype: torch.dtype, op: str, seed: int
) -> None:
    n = len(peers)
    inputs = [make_input(r, shape, dtype, seed) for r in range(n)]
    before = [t.clone() for t in inputs]
    parts = await asyncio.gather(
        *(p.reduce_scatter(t, op) for p, t in zip(peers, inputs, strict=True))
    )
    ref = reference_sum(inputs) / (n if op == "mean" else 1)
    chunks = torch.tensor_split(ref.reshape(-1), n)
    for r, part in enumerate(parts):
        assert part.shape == chunks[r].shape
        torch.testing.assert_close(part.to(torch.float64), chunks[r], **tolerance(dtype))
    for t, b in zip(inputs, before, strict=True):
        assert torch.equal(t, b), "reduce_scatter must not modify its input"


async def check_reduce_scatter_tensor(
    peers: list[fg.Peer], per_rank: int, dtype: torch.dtype, seed: int
) -> None:
    n = len(peers)
    inputs = [make_input(r, (n * per_rank,), dtype, seed) for r in range(n)]
    outs = [torch.empty(per_rank, dtype=dtype) for _ in range(n)]
    await asyncio.gather(
        *(p.reduce_scatter_tensor(o, t) for p, o, t in zip(peers, outs, inputs, strict=True))
    )
    ref = reference_sum(inputs)
    for r, o in enumerate(outs):
        torch.testing.assert_close(
            o.to(torch.float64), ref[r * per_rank : (r + 1) * per_rank], **tolerance(dtype)
        )


async def check_broadcast(
    peers: list[fg.Peer], shape: tuple[int, ...], dtype: torch.dtype, root: int, seed: int
) -> None:
    n = len(peers)
    inputs = [make_input(r, shape, dtype, seed) for r in range(n)]
    expected = inputs[root].clone()
    await asyncio.gather(*(p.broadcast(t, root) for p, t in zip(peers, inputs, strict=True)))
    for t in inputs:
        assert torch.equal(t, expected)


async def run_conformance(
    peers: list[fg.Peer], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]] = SHAPES
) -> None:
    n = len(peers)
    seed = 0
    for dtype in dtypes:
        if dtype == torch.bool:
            ops = ["max", "min"]
        elif dtype in NARROW:
            ops = ["max", "min", "bxor", "sum"]
        else:
            ops = ["sum", "max", "min", "product"] + (
                ["mean"] if dtype.is_floating_point else ["bxor"]
            )
        for shape in shapes:
            seed += 1
            for op in ops:
                await check_all_reduce(peers, shape, dtype, op, seed)
            await check_all_gather(peers, shape, dtype, seed)
            if dtype != torch.bool:
                await check_reduce_scatter(
                    peers, shape, dtype, "mean" if dtype.is_floating_point else "sum", seed
                )
            await check_broadcast(peers, shape, dtype, seed % n, seed)
        if dtype != torch.bool:
            await check_reduce_scatter_tensor(peers, 5, dtype, seed)
    await asyncio.gather(*(p.barrier() for p in peers))
