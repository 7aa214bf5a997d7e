"""Collectives on N peers in one event loop, over both transports, against a
float64 reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms import ring as lane
from ferrogrpc.algorithms.exchange_plan import SMALL_BYTES
from ferrogrpc.samehost import plane as local
from ferrogrpc.v1 import collective_pb2 as pb
from tests.conformance import check_all_reduce, run_conformance
from tests.helpers import count_exchanges, reference_sum

pytestmark = pytest.mark.timeout(120)

ALL_DTYPES = list(fg.SUPPORTED_DTYPES)
SMALL = fg.ChunkPolicy(chunk_bytes=64, max_lanes=3, lane_min_bytes=256)


# World 5 over gRPC is the held-forwards case below (its default transport).
@pytest.mark.parametrize(
    ("world", "transport"),
    [(w, t) for w in (1, 2, 3, 5) for t in ("memory", "grpc", "shm") if (w, t) != (5, "grpc")],
)
async def test_conformance_every_dtype_and_shape(
    transport: str, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiny chunks and lanes, so that even small tensors take many chunks,
    # several lanes and uneven segments; on the same-host plane, tiny slots,
    # so that they take many rounds and every slot is reused.
    monkeypatch.setattr(local, "SLOT_BYTES", 64)
    async with fg.testing.local_group(world, transport=transport, chunk_policy=SMALL) as peers:  # type: ignore[arg-type]
        await run_conformance(peers, ALL_DTYPES)


# Every holding mode at world 3; at world 5 (longer rings, more forwards)
# the mixed mode only, which takes both paths in one collective.
@pytest.mark.parametrize(
    ("world", "held", "held_bytes"),
    [
        (3, 0, 1 << 40),
        (3, 1, 1 << 40),
        (3, 10_000, 1 << 40),
        (3, 10_000, 100),
        (5, 10_000, 100),
    ],
)
async def test_conformance_whether_or_not_forwards_are_held(
    world: int, held: int, held_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lane keeps up to HELD_MESSAGES forwarded messages, and HELD_BYTES
    # (one message at least), ready for its sender and writes the rest to
    # the tensor; both paths, and their mix, give the same results.
    monkeypatch.setattr(lane, "HELD_MESSAGES", held)
    monkeypatch.setattr(lane, "HELD_BYTES", held_bytes)
    async with fg.testing.local_group(world, chunk_policy=SMALL) as peers:
        await run_conformance(peers, ALL_DTYPES)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("world", [2, 3])
async def test_large_float64_all_reduce_default_policy(world: int, transport: str) -> None:
    async with fg.testing.local_group(world, transport=transport) as peers:  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(7)
        inputs = [torch.randn(3_000_001, generator=gen, dtype=torch.float64) for _ in range(world)]
        tensors = [t.clone() for t in inputs]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
        ref = reference_sum(inputs)
        for t in tensors:
            torch.testing.assert_close(t, ref, atol=1e-12, rtol=1e-12)


async def test_rings_where_some_ranks_send_empty_chunks() -> None:
    # Past SMALL_WORLD ranks every collective is a ring, and a tensor with
    # fewer elements than ranks leaves some ranks empty chunks to send: the
    # first of them too, which then travels on its own, not in the stream's
    # opening (intake.py, [Note: the opening message]).
    world = 17
    async with fg.testing.local_group(world, transport="memory") as peers:
        gen = torch.Generator().manual_seed(3)
        for numel in (3, world + 2):
            inputs = [torch.randn(numel, generator=gen) for _ in range(world)]
            tensors = [t.clone() for t in inputs]
            await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
            ref = reference_sum(inputs).float()
            for t in tensors:
                torch.testing.assert_close(t, ref, atol=1e-5, rtol=1e-6)
            roots = [t.clone() for t in inputs]
            await asyncio.gather(*(p.broadcast(t, 16) for p, t in zip(peers, roots, strict=True)))
            for t in roots:
                assert torch.equal(t, inputs[16])
        # A reduce-scatter of fewer elements than ranks: some parts are empty.
        ins = [torch.randn(6, generator=gen) for _ in range(world)]
        outs = await asyncio.gather(*(p.reduce_scatter(i) for p, i in zip(peers, ins, strict=True)))
        parts = torch.tensor_split(reference_sum(ins).float(), world)
        for out, part in zip(outs, parts, strict=True):
            torch.testing.assert_close(out, part, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_sixteen_concurrent_all_reduces_on_four_ranks(transport: str) -> None:
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
    async with fg.testing.local_group(4, transport=transport) as peers:  # type: ignore[arg-type]
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


@pytest.mark.parametrize("transport", ["memory", "grpc", "shm"])
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
            peers[0].all_reduce(torch.ones(2), "median")


@pytest.mark.parametrize(
    "hosts",
    [
        ["a", "a", "b", "b"],  # 2 hosts x 2 ranks
        # 2 + 1: in real processes in test_multihost (network namespaces)
        ["a", "b", "b", "b"],  # 1 + 3
        ["a", "b", "a", "b"],  # ranks of a host not adjacent
        ["b", "a", "a"],
    ],
)
async def test_conformance_two_level_collectives(
    hosts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several hosts, some with several ranks: shared memory inside a host,
    # gRPC rings across (one process plays every host). Tiny slots and
    # chunks: many rounds and chunks per collective.
    monkeypatch.setattr(local, "SLOT_BYTES", 64)
    async with fg.testing.local_group(
        len(hosts), transport="shm", hosts=hosts, chunk_policy=SMALL
    ) as peers:
        await run_conformance(peers, ALL_DTYPES)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("numel", [3 * 1000 + 7, 3 * 30_000 + 7])
@pytest.mark.parametrize("transport", ["grpc", "memory", "shm"])
async def test_all_gather_and_reduce_scatter_leave_inputs_byte_identical(
    transport: str, numel: int
) -> None:
    # README: "the input of reduce_scatter/all_gather is never modified".
    # Byte for byte: -0.0 and a NaN with a payload are inputs too. 12 KB
    # takes the small collectives' one exchange; 360 KB the rings, in
    # segments of ~30 chunks, so that partial sums outnumber the forwards a
    # lane may hold and every reduction path runs (on shm, many slot rounds).
    world = 3
    policy = fg.ChunkPolicy(chunk_bytes=4096)
    async with fg.testing.local_group(world, transport=transport, chunk_policy=policy) as peers:  # type: ignore[arg-type]
        inputs = []
        for r in range(world):
            t = torch.randn(numel, generator=torch.Generator().manual_seed(r))
            t[5] = -0.0
            t[7 + r] = torch.tensor([0x7FC0_1234 + r], dtype=torch.int32).view(torch.float32)
            inputs.append(t)
        originals = [_raw(t) for t in inputs]
        nan = torch.isnan(torch.stack(inputs)).any(0)
        ref = reference_sum(inputs)

        def unchanged(what: str) -> None:
            for r, (t, raw) in enumerate(zip(inputs, originals, strict=True)):
                assert _raw(t) == raw, f"{what} on {transport} modified rank {r}'s input"

        parts = await asyncio.gather(*(p.all_gather(t) for p, t in zip(peers, inputs, strict=True)))
        unchanged("all_gather")
        for got in parts:
            assert [_raw(g) for g in got] == originals
        outs = [torch.empty(world * numel) for _ in range(world)]
        await asyncio.gather(
            *(p.all_gather_into_tensor(o, t) for p, o, t in zip(peers, outs, inputs, strict=True))
        )
        unchanged("all_gather_into_tensor")
        assert all(_raw(o) == b"".join(originals) for o in outs)
        for op in ("sum", "mean", "max"):
            mine = await asyncio.gather(
                *(p.reduce_scatter(t, op) for p, t in zip(peers, inputs, strict=True))
            )
            unchanged(f"reduce_scatter {op}")
            if op == "sum":
                got = torch.cat(mine).double()
                torch.testing.assert_close(got[~nan], ref[~nan], atol=1e-5, rtol=1e-5)
                assert bool(got[nan].isnan().all())
        padded = [torch.cat([t, torch.zeros(2)]) for t in inputs]  # divisible by 3
        padded_raw = [_raw(t) for t in padded]
        outs = [torch.empty((numel + 2) // world) for _ in range(world)]
        await asyncio.gather(
            *(p.reduce_scatter_tensor(o, t) for p, o, t in zip(peers, outs, padded, strict=True))
        )
        assert [_raw(t) for t in padded] == padded_raw, "reduce_scatter_tensor modified its input"


@pytest.mark.parametrize(
    ("hosts", "one_exchange"),
    [(["a", "b", "c"], True), (["a", "a", "b", "b"], False)],
    ids=["a-rank-per-host", "2x2"],
)
async def test_gathers_and_scatters_are_small_by_part_unless_hosts_share_ranks(
    hosts: list[str], one_exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A part of SMALL_BYTES per rank (the whole tensor world times that):
    # one exchange with a rank per host (on one host: test_direct.py); the
    # two-level path where hosts hold several ranks each, whose one exchange
    # would send every part to every rank of the other host. Results
    # against float64.
    world, part = len(hosts), SMALL_BYTES // 8
    xs = [torch.randn(part, dtype=torch.float64) for _ in range(world)]
    full = [torch.randn(world * part - 1, dtype=torch.float64) for _ in range(world)]
    async with fg.testing.local_group(world, transport="shm", hosts=hosts) as peers:
        exchanges = count_exchanges(monkeypatch)  # after the start-up's own
        outs = [torch.empty(world * part, dtype=torch.float64) for _ in range(world)]
        await asyncio.gather(
            *(p.all_gather_into_tensor(o, x) for p, o, x in zip(peers, outs, xs, strict=True))
        )
        parts = await asyncio.gather(
            *(p.reduce_scatter(f) for p, f in zip(peers, full, strict=True))
        )
    for rank in range(world):
        torch.testing.assert_close(outs[rank], torch.cat(xs), rtol=0, atol=0)
        ref = torch.stack(full).sum(0).tensor_split(world)[rank]
        torch.testing.assert_close(parts[rank], ref, rtol=0, atol=1e-12)
    expected = [pb.ALL_GATHER, pb.REDUCE_SCATTER] * world if one_exchange else []
    assert sorted(exchanges) == sorted(expected)
