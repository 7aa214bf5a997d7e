"""The ring schedule, executed on plain tensors without any transport."""

from __future__ import annotations

import itertools

import pytest
import torch

from ferrogrpc.algorithms import schedule
from ferrogrpc.algorithms.descriptor import make_descriptor
from ferrogrpc.algorithms.schedule import COPY, REDUCE, REDUCE_LAST
from ferrogrpc.ops import ReduceOp
from ferrogrpc.runtime.engine import _loopback
from ferrogrpc.v1 import collective_pb2 as pb

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("numel", [0, 1, 5, 7, 64, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_split_bounds_matches_tensor_split(numel: int, parts: int) -> None:
    t = torch.arange(numel)
    expected = [
        (int(c[0]), int(c[-1]) + 1) if c.numel() else None for c in torch.tensor_split(t, parts)
    ]
    got = schedule.split_bounds(0, numel, parts)
    assert len(got) == parts
    for (lo, hi), exp in zip(got, expected, strict=True):
        if exp is None:
            assert lo == hi
        else:
            assert (lo, hi) == exp


def test_chunk_bounds_cover_range_and_empty_range_has_one_chunk() -> None:
    assert schedule.chunk_bounds((3, 3), 4) == [(3, 3)]
    assert schedule.chunk_bounds((0, 10), 4) == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_reduce_scatter_steps_end_with_own_segment(world: int) -> None:
    for rank in range(world):
        steps = schedule.reduce_scatter_steps(rank, world)
        assert len(steps) == world - 1
        assert steps[-1].recv == rank
        ag = schedule.all_gather_steps(rank, world)
        assert ag[0].send == rank
        # Every step forwards exactly what was received the step before.
        both = steps + ag
        for prev, nxt in itertools.pairwise(both):
            assert nxt.send == prev.recv
        # A rank's send at step k is its right neighbour's receive at step k.
        right = schedule.reduce_scatter_steps((rank + 1) % world, world)
        assert [s.send for s in steps] == [s.recv for s in right]


def _simulate(world: int, numel: int, lanes: int, chunk: int, kind: str) -> list[torch.Tensor]:
    """Run every rank's plans in lock step over in-memory 'wires'."""
    layout = schedule.Layout.build(numel, world, lanes, chunk)
    data = [torch.arange(numel, dtype=torch.float64) * (r + 1) + r for r in range(world)]
    plans = []
    for r in range(world):
        steps = (
            schedule.all_reduce_steps(r, world)
            if kind == "all_reduce"
            else schedule.reduce_scatter_steps(r, world)
        )
        plans.append([schedule.ring_plan(layout, lane, steps) for lane in range(lanes)])
    for lane in range(lanes):
        # wires[r] carries rank r's sends to rank r+1 on this lane, in order.
        wires: dict[int, list[torch.Tensor]] = {r: [] for r in range(world)}
        cursors = [0] * world
        received = [0] * world
        progressed = True
        while progressed:
            progressed = False
            for r in range(world):
                plan = plans[r][lane]
                left = (r - 1) % world
                lplan = plans[left][lane]
                # Rank r may apply receive item i when left has sent item i.
                i = received[r]
                if i < len(plan.recvs) and cursors[left] > i:
                    item = plan.recvs[i]
                    sent = lplan.sends[i]
                    assert (sent.lo, sent.hi) == (item.lo, item.hi)
                    payload = wires[left][i]
                    if item.action == COPY:
                        data[r][item.lo : item.hi] = payload
                    else:
                        data[r][item.lo : item.hi] += payload
                    received[r] += 1
                    progressed = True
                j = cursors[r]
                if j < len(plan.sends) and plan.sends[j].after <= received[r]:
                    s = plan.sends[j]
                    wires[r].append(data[r][s.lo : s.hi].clone())
                    cursors[r] += 1
                    progressed = True
        assert all(received[r] == len(plans[r][lane].recvs) for r in range(world))
    return data


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("numel", [1, 7, 33, 100])
@pytest.mark.parametrize("lanes", [1, 3])
def test_all_reduce_plan_computes_the_sum(world: int, numel: int, lanes: int) -> None:
    result = _simulate(world, numel, lanes, 4, "all_reduce")
    expected = sum(torch.arange(numel, dtype=torch.float64) * (r + 1) + r for r in range(world))
    for r in range(world):
        torch.testing.assert_close(result[r], expected)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_plan_finishes_each_rank_segment(world: int) -> None:
    numel = 23
    result = _simulate(world, numel, 2, 3, "reduce_scatter")
    expected = sum(torch.arange(numel, dtype=torch.float64) * (r + 1) + r for r in range(world))
    for r, (lo, hi) in enumerate(schedule.split_bounds(0, numel, world)):
        torch.testing.assert_close(result[r][lo:hi], expected[lo:hi])


def test_last_reduce_is_marked_for_mean() -> None:
    layout = schedule.Layout.build(10, 3, 1, 100)
    plan = schedule.ring_plan(layout, 0, schedule.all_reduce_steps(0, 3))
    actions = [i.action for i in plan.recvs]
    assert actions == [REDUCE, REDUCE_LAST, COPY, COPY]


def test_broadcast_plan_is_a_pipelined_chain() -> None:
    layout = schedule.Layout.build(10, 1, 1, 4)
    root = schedule.broadcast_plan(layout, 0, rank=2, root=2, world=4)
    assert [s.after for s in root.sends] == [0, 0, 0] and root.recvs == ()
    middle = schedule.broadcast_plan(layout, 0, rank=3, root=2, world=4)
    assert [s.after for s in middle.sends] == [1, 2, 3] and len(middle.recvs) == 3
    last = schedule.broadcast_plan(layout, 0, rank=1, root=2, world=4)
    assert last.sends == () and len(last.recvs) == 3


def test_lane_count() -> None:
    assert schedule.lane_count(0, 4, 1 << 20) == 1
    assert schedule.lane_count(3 << 20, 4, 1 << 20) == 3
    assert schedule.lane_count(64 << 20, 4, 1 << 20) == 4


def test_link_chunks_give_a_segment_four_chunks_but_none_under_256_kib() -> None:
    # [Note: chunks on a link]: 16 MiB at world 4 has 4 MiB segments: the
    # default 4 MiB chunk becomes 1 MiB; 64 MiB (16 MiB segments) keeps 4 MiB;
    # 4 MiB at world 4 (1 MiB segments) gets 256 KiB chunks, and nothing
    # goes under 256 KiB; world 2's 1 MiB stays from 8 MiB up.
    mib = 1 << 20
    assert schedule.link_chunk_bytes(4 * mib, 16 * mib, 4) == 1 * mib
    assert schedule.link_chunk_bytes(4 * mib, 32 * mib, 4) == 2 * mib
    assert schedule.link_chunk_bytes(4 * mib, 64 * mib, 4) == 4 * mib
    assert schedule.link_chunk_bytes(4 * mib, 4 * mib, 4) == 256 << 10
    assert schedule.link_chunk_bytes(4 * mib, 1 * mib, 4) == 256 << 10
    assert schedule.link_chunk_bytes(1 * mib, 64 * mib, 2) == 1 * mib
    assert schedule.link_chunk_bytes(1 * mib, 8 * mib, 2) == 1 * mib
    assert schedule.link_chunk_bytes(1 * mib, 2 * mib, 2) == 256 << 10


def test_only_a_group_across_hosts_cuts_chunks_for_the_link() -> None:
    assert _loopback("127.0.0.1:29500") and _loopback("[::1]:1") and _loopback("localhost:2")
    assert not _loopback("198.18.0.10:29500") and not _loopback("rank-3:29500")
    buf = torch.empty(4 << 20)  # 16 MiB of float32
    for link, chunk in ((False, 4 << 20), (True, 1 << 20)):
        d = make_descriptor(
            pb.ALL_REDUCE, buf, ReduceOp.SUM, 0, 4, (4 << 20, 1), 4 << 20, None, None, link
        )
        assert d.chunk_elems * 4 == chunk, (link, d.chunk_elems)
    # In bfloat16 on the wire the segment is half the bytes: 512 KiB chunks,
    # each of 256K elements.
    d = make_descriptor(
        pb.ALL_REDUCE, buf, ReduceOp.SUM, 0, 4, (4 << 20, 1), 4 << 20, None, torch.bfloat16, True
    )
    assert d.chunk_elems * 2 == 512 << 10
    # A 2 MiB float32 all_reduce at world 4 (512 KiB segments) would get
    # 128 KiB chunks: the floor makes them 256 KiB.
    d = make_descriptor(
        pb.ALL_REDUCE,
        torch.empty(512 << 10),
        ReduceOp.SUM,
        0,
        4,
        (4 << 20, 1),
        4 << 20,
        None,
        None,
        True,
    )
    assert d.chunk_elems * 4 == 256 << 10
