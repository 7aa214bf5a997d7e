"""Every collective above the small-collective bound, through each path a
large tensor takes: rings over gRPC and over the in-memory transport, rounds
through shared segments (tiny slots, each reused many times), and two levels
(2x2, 2+1); every op, MEAN included, a broadcast from a non-lowest root, and
a narrower wire dtype. Results against float64 references (tests/conformance.py),
and each path checked to be the one that ran."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms.exchange_plan import SMALL_BYTES
from ferrogrpc.algorithms.jobs import Job
from ferrogrpc.runtime.engine import Engine
from ferrogrpc.samehost import plane as samehost_plane
from tests.conformance import (
    check_all_gather,
    check_all_reduce,
    check_broadcast,
    check_reduce_scatter,
    check_reduce_scatter_tensor,
)

pytestmark = pytest.mark.timeout(120)

# One rank's part just above the bound: every op here runs the long way.
PART = SMALL_BYTES // 4 + 1000
CHUNKS = fg.ChunkPolicy(chunk_bytes=32 << 10, max_lanes=2, lane_min_bytes=64 << 10)
PATHS = {
    # name: (world, transport, hosts, the runner that must run)
    "grpc ring": (3, "grpc", None, "ring"),
    "memory ring": (3, "memory", None, "ring"),
    "shared-memory rounds": (3, "shm", None, "LocalRunner"),
    "two-level 2x2": (4, "shm", ["a", "a", "b", "b"], "HierRunner"),
    "two-level 2+1": (3, "shm", ["a", "a", "b"], "HierRunner"),
}


def _record_runners(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    pick = Engine._runner

    def recording(self: Engine, job: Job) -> object:
        run, here = pick(self, job)
        owner = getattr(run, "__self__", None)
        name = type(owner).__name__ if owner is not None else "ring"
        seen["Direct" if job.direct else name] += 1
        return run, here

    monkeypatch.setattr(Engine, "_runner", recording)
    return seen


def _group_on(path: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A group of ``path``'s world on its transport and hosts, with tiny
    slots: a collective through the segments takes many rounds, and every
    slot is reused."""
    world, transport, hosts, _ = PATHS[path]
    monkeypatch.setattr(samehost_plane, "SLOT_BYTES", 4096)
    return fg.testing.local_group(
        world,
        transport=transport,  # type: ignore[arg-type]
        hosts=hosts,
        chunk_policy=CHUNKS,
    )


@pytest.mark.parametrize("path", list(PATHS))
async def test_every_op_above_the_small_bound_on_every_path(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    world, _, _, runner = PATHS[path]
    seen = _record_runners(monkeypatch)
    async with _group_on(path, monkeypatch) as peers:
        seed = 100
        for dtype in (torch.float32, torch.int32):
            ops = ["sum", "mean", "max", "min"] if dtype.is_floating_point else ["sum", "max"]
            for op in ops:
                seed += 1
                await check_all_reduce(peers, (PART,), dtype, op, seed)
                if op in ("sum", "mean"):
                    await check_reduce_scatter(peers, (world * PART,), dtype, op, seed)
            await check_all_gather(peers, (PART,), dtype, seed)
            await check_reduce_scatter_tensor(peers, PART, dtype, seed)
            # From every root: the non-lowest ranks of a host included.
            for root in range(world):
                await check_broadcast(peers, (PART,), dtype, root, seed + root)
        await asyncio.gather(*(p.barrier() for p in peers))
    # Only the barriers are small (one exchange, or the direct sockets).
    assert set(seen) - {"SmallRunner", "Direct"} == {runner}, seen
    assert seen[runner] >= 20, seen


def _a2a_splits(world: int, inline: int, big: int) -> list[list[int]]:
    """Elements rank s sends rank d: rank 0 one large piece (elastic FSDP's
    hand-over to a buddy has that shape) and one of exactly ``inline``
    elements (the most that travel in the first message); every other rank
    two large pieces (which split its slot), one of ``inline + 1`` (the
    least that goes through the slots), or of ``inline``."""
    rows = [[5, big, inline] + [0] * (world - 3)]
    for s in range(1, world):
        sizes = [inline, big + s, inline + 1, 2 * big + s]
        rows.append([sizes[(s + d) % 4] for d in range(world)])
    return rows


@pytest.mark.parametrize("path", ["grpc ring", "shared-memory rounds", "two-level 2x2"])
async def test_an_uneven_all_to_all_gives_every_rank_exactly_its_pieces(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where one host holds the group, an all_to_all runs on its plane
    # (shm_rounds.LocalGroup.all_to_all): the small pieces in the first
    # message, the large ones through tiny slots in many rounds (a rank
    # with several large pieces splits its slot among them). Elsewhere, in
    # one exchange. Every piece lands where the splits say, bit for bit.
    from ferrogrpc.algorithms import shm_rounds

    world, _, _, runner = PATHS[path]
    monkeypatch.setattr(shm_rounds, "INLINE_BYTES", 64)
    seen = _record_runners(monkeypatch)
    async with _group_on(path, monkeypatch) as peers:
        # (Second pass: at most 40 bytes of a piece a round, below the
        # slot's share: A2A_ROUND_BYTES sets the rounds.)
        for dtype, cap in ((torch.float64, None), (torch.int16, None), (torch.float64, 40)):
            if cap is not None:
                monkeypatch.setattr(shm_rounds, "A2A_ROUND_BYTES", cap)
            rows = _a2a_splits(world, shm_rounds.INLINE_BYTES // dtype.itemsize, 1000)
            gen = torch.Generator().manual_seed(5)
            ins = [
                (torch.randn(sum(rows[s]), generator=gen) * 1000).to(dtype) for s in range(world)
            ]
            pieces = [list(torch.split(ins[s], rows[s])) for s in range(world)]
            outs = [torch.full((sum(r[d] for r in rows),), -1, dtype=dtype) for d in range(world)]
            await asyncio.gather(
                *(
                    peers[r].all_to_all_single(
                        outs[r], ins[r], [rows[s][r] for s in range(world)], rows[r]
                    )
                    for r in range(world)
                )
            )
            for d in range(world):
                assert torch.equal(outs[d], torch.cat([pieces[s][d] for s in range(world)])), d
    want = "LocalRunner" if runner == "LocalRunner" else "SmallRunner"
    assert seen[want] >= 2, seen


async def test_an_all_to_all_size_one_rank_does_not_expect_is_named_on_the_plane() -> None:
    # Rank 1 expects 5 elements from rank 0, which sends it 4: a
    # ProtocolError on rank 1 naming rank 0 and both sizes, not a hang or
    # a torn copy.
    async with fg.testing.local_group(3, transport="shm", timeouts=TIMEOUTS) as peers:
        calls = [
            peers[0].all_to_all_single(torch.empty(3), torch.zeros(7), [3, 0, 0], [3, 4, 0]),
            peers[1].all_to_all_single(torch.empty(5), torch.zeros(0), [5, 0, 0], [0, 0, 0]),
            peers[2].all_to_all_single(torch.empty(0), torch.zeros(0), [0, 0, 0], [0, 0, 0]),
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
    err = results[1]
    assert isinstance(err, fg.ProtocolError), results
    assert "rank 0" in str(err) and "16 bytes" in str(err) and "20" in str(err), err


TIMEOUTS = fg.Timeouts(collective=15, idle=8, connect=20)


@pytest.mark.parametrize("path", ["grpc ring", "two-level 2x2"])
async def test_a_bfloat16_wire_gives_every_rank_the_same_values(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Across gRPC every rank's values (its own included) are rounded to the
    # wire dtype, so all ranks hold bitwise the same result, within the bound.
    world, _, hosts, _ = PATHS[path]
    async with _group_on(path, monkeypatch) as peers:
        gen = torch.Generator().manual_seed(7)
        inputs = [torch.randn(PART, generator=gen) for _ in range(world)]
        tensors = [t.clone() for t in inputs]
        await asyncio.gather(
            *(
                p.all_reduce(t, "sum", wire_dtype=torch.bfloat16)
                for p, t in zip(peers, tensors, strict=True)
            )
        )
        exact = torch.stack([t.double() for t in inputs]).sum(0)
        bound = world * 2**-8 * torch.stack([t.double().abs() for t in inputs]).sum(0)
        for t in tensors:
            assert torch.equal(t, tensors[0])
            assert ((t.double() - exact).abs() <= bound + 1e-6).all()
        outs = [torch.empty(world * PART) for _ in range(world)]
        await asyncio.gather(
            *(
                p.all_gather_into_tensor(o, t, wire_dtype=torch.bfloat16)
                for p, o, t in zip(peers, outs, inputs, strict=True)
            )
        )
        if hosts is None:
            # A ring: every block crosses gRPC in bfloat16, its own included.
            expected = torch.cat([t.to(torch.bfloat16).float() for t in inputs])
        else:
            # Two levels gather exactly (an integer sum): no wire dtype there.
            expected = torch.cat(inputs)
        for o in outs:
            assert torch.equal(o, expected)


@pytest.mark.parametrize("path", ["shared-memory rounds", "two-level 2x2"])
async def test_a_root_that_runs_ahead_never_reuses_a_slot_still_being_read(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh group's first collective is a broadcast: the root only writes,
    # so it runs rounds ahead of its readers, and must wait for them before
    # it writes over a slot (the plane's round counter starts here: the
    # first reuse is the one that counts).
    world = PATHS[path][0]
    async with _group_on(path, monkeypatch) as peers:
        await check_broadcast(peers, (PART,), torch.float32, world - 1, seed=3)


async def _broadcast_with_a_late_rank(
    peers: list[fg.Peer], root: int, late: int
) -> tuple[list[torch.Tensor], dict[int, float], float]:
    """Every rank broadcasts from ``root``, ``late`` 0.3 s after the others:
    the tensors, when each rank returned, and when the late one called."""
    loop = asyncio.get_running_loop()
    tensors = [torch.full((SMALL_BYTES // 4 + 1000,), float(r)) for r in range(3)]
    start = loop.time()
    returned: dict[int, float] = {}
    called: list[float] = []

    async def call(r: int) -> None:
        if r == late:
            await asyncio.sleep(0.3)
            called.append(loop.time() - start)
        await peers[r].broadcast(tensors[r], root=root)
        returned[r] = loop.time() - start

    await asyncio.gather(*(call(r) for r in range(3)))
    return tensors, returned, called[0]


@pytest.mark.parametrize("root", [0, 2])
async def test_a_broadcast_root_returns_only_once_the_last_rank_has_the_data(root: int) -> None:
    # A chain broadcast just above the small bound, each non-root rank in
    # turn calling 0.3 s late: no rank, the root included, returns before
    # the late one has even called (so before it has the data), and every
    # rank ends with the root's values.
    chunks = fg.ChunkPolicy(chunk_bytes=128 << 10, max_lanes=1)
    async with fg.testing.local_group(3, chunk_policy=chunks) as peers:
        for late in [r for r in range(3) if r != root]:
            tensors, returned, called = await _broadcast_with_a_late_rank(peers, root, late)
            for r in range(3):
                assert returned[r] >= called, (root, late, r, returned, called)
                assert bool((tensors[r] == float(root)).all()), (root, late, r)
