"""A call that one rank's own argument checks refuse (issue 17, item 2).

Before: the refusing rank raised, sent nothing, and the other ranks waited
for it until FERROGRPC_TIMEOUT (300 s), then raised a timeout naming no
rank. Now the refused call still takes its sequence number and tells every
rank: each fails that collective within moments with a ConfigError naming
the refusing rank and its message, whichever path (one exchange, shared
memory, two levels, rings) it took, and the group goes on working. Every
result afterwards is checked against a float64 reference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.errors import Evidence, Identity
from ferrogrpc.failure.policy import FailurePolicy
from ferrogrpc.transport import wire
from ferrogrpc.v1 import collective_pb2 as pb
from tests.helpers import ServedJob, reference_sum

pytestmark = pytest.mark.timeout(90)

# Long deadlines: a rank that waited for a refusing one would fail the 5 s bar.
SLOW = fg.Timeouts(collective=60, idle=30, connect=20)
BAR_S = 5.0
BIG = 1 << 20  # 4 MiB of float32: rings, shared-memory rounds, two levels
SMALL = 1000  # one exchange

# (transport, world, hosts): every data path a collective can take.
PATHS = {
    "grpc": ("grpc", 3, None),
    "memory": ("memory", 3, None),
    "shm": ("shm", 3, None),
    "two-level": ("shm", 4, ["a", "a", "b", "b"]),
}


def _inputs(world: int, n: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(n, generator=g) for _ in range(world)]


async def _check_usable(peers: list[fg.Peer], n: int, step: int) -> None:
    """Every rank all-reduces; each result equals the float64 sum."""
    inputs = _inputs(len(peers), n, step)
    ref = reference_sum(inputs)
    outs = [t.clone() for t in inputs]
    await asyncio.wait_for(
        asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, outs, strict=True))), 30
    )
    for t in outs:
        torch.testing.assert_close(t.double(), ref, atol=1e-4, rtol=1e-5)


def _assert_names(err: BaseException, rank: int, message: str) -> None:
    assert isinstance(err, fg.ConfigError), repr(err)
    assert err.peer == rank, err
    assert f"rank {rank}'s own argument checks refused its call" in str(err), err
    assert message in str(err), err


def _ring_opened(peer: fg.Peer) -> asyncio.Event:
    """An event set once ``peer`` opens a ring stream for an all_reduce
    (its first message: a descriptor, no payload)."""
    opened = asyncio.Event()
    transport = peer._ctx.transport  # test access: the transport's send hook

    def hook(dst: int, message: bytes) -> bytes:
        header, _ = wire.decode(message)
        if header.HasField("descriptor") and header.descriptor.kind == pb.ALL_REDUCE:
            opened.set()
        return message

    transport.send_hook = hook  # type: ignore[attr-defined]
    return opened


@pytest.mark.parametrize("size", [SMALL, BIG], ids=["small", "big"])
@pytest.mark.parametrize("when", ["first", "last"])
@pytest.mark.parametrize("path", list(PATHS))
async def test_a_refused_call_fails_every_rank_naming_it(
    path: str, when: str, size: int, report: Callable[[str], None]
) -> None:
    transport, world, hosts = PATHS[path]
    options: dict[str, Any] = {"hosts": hosts} if hosts else {}
    async with fg.testing.local_group(
        world, transport=transport, timeouts=SLOW, **options
    ) as peers:
        await _check_usable(peers, size, 1)
        others = [r for r in range(world) if r != 1]
        bad = torch.ones(size, dtype=torch.int64)
        message = "MEAN is not defined for integer dtype torch.int64"
        two_level_rings = path == "two-level" and size == BIG
        opened = [_ring_opened(peers[r]) for r in (2, 3)] if two_level_rings else []
        start = time.monotonic()
        if when == "first":
            with pytest.raises(fg.ConfigError, match=message) as own:
                peers[1].all_reduce(bad, "mean")
            # "First": the refusal has reached every rank before it calls.
            assert own.value.seq is not None
            deadline = time.monotonic() + BAR_S
            while not all(fg.testing.refusal(peers[r], own.value.seq) for r in others):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
        calls = [asyncio.ensure_future(peers[r].all_reduce(torch.ones(size))) for r in others]
        if when == "last":
            # The others are in the collective, waiting for rank 1 (in two
            # levels: host b's ranks are past their shared-memory rounds,
            # streaming to host a, whose rank 0 waits for rank 1).
            for event in opened:
                await asyncio.wait_for(event.wait(), 10)
            start = time.monotonic()
            with pytest.raises(fg.ConfigError, match=message) as own:
                peers[1].all_reduce(bad, "mean")
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
        took = time.monotonic() - start
        assert own.value.seq is not None and own.value.rank == 1, own.value
        for r, res in zip(others, results, strict=True):
            _assert_names(res, 1, message)
            assert isinstance(res, fg.ConfigError)
            assert res.rank == r and res.seq == own.value.seq and res.op == "all_reduce", res
        assert took < BAR_S, took
        report(
            f"refused all_reduce ({path}, {size} elements, refuser {when}): every rank failed "
            f"in {took * 1000:.0f} ms naming rank 1"
        )
        for p in peers:
            assert fg.testing.broken(p) is None
            assert fg.testing.last_seq(p) == own.value.seq
        await _check_usable(peers, size, 2)
        await _check_usable(peers, SMALL if size == BIG else BIG, 3)


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(*shape, dtype=dtype)


Call = Callable[[fg.Peer], Coroutine[Any, Any, Any]]

# name: (the refused call on rank 1, the matching call of every other rank,
# what the refusal says). The refused call raises before returning a coroutine.
CASES: dict[str, tuple[Callable[[fg.Peer], object], Call, str]] = {
    "mean of an int tensor": (
        lambda p: p.all_reduce(_t(6, dtype=torch.int32), "mean"),
        lambda p: p.all_reduce(_t(6, dtype=torch.int32), "sum"),
        "MEAN is not defined for integer dtype torch.int32",
    ),
    "root out of range": (
        lambda p: p.broadcast(_t(6), 5),
        lambda p: p.broadcast(_t(6), 0),
        "root must be a rank in [0, 2), got 5",
    ),
    "unsupported dtype": (
        lambda p: p.all_reduce(_t(6, dtype=torch.complex64)),
        lambda p: p.all_reduce(_t(6)),
        "unsupported dtype torch.complex64",
    ),
    "all_to_all splits that do not add up": (
        lambda p: p.all_to_all_single(_t(4), _t(4), [2, 2], [1, 1]),
        lambda p: p.all_to_all_single(_t(4), _t(4)),
        "in_splits",
    ),
    "not a tensor": (
        lambda p: p.all_gather([1.0, 2.0]),  # type: ignore[arg-type]
        lambda p: p.all_gather(_t(2)),
        "TypeError: all_gather: tensor must be a torch.Tensor, got list",
    ),
    "stride-0 in-place tensor": (
        lambda p: p.all_reduce(_t(1, 6).expand(4, 6)),
        lambda p: p.all_reduce(_t(4, 6)),
        "has elements that share memory",
    ),
    "self-overlapping out": (
        lambda p: p.all_gather_into_tensor(torch.zeros(16).as_strided((2, 6), (1, 1)), _t(6)),
        lambda p: p.all_gather_into_tensor(torch.zeros(2, 6), _t(6)),
        "out (shape (2, 6), stride (1, 1)) has elements that share memory",
    ),
    "wrong out size": (
        lambda p: p.reduce_scatter_tensor(torch.zeros(3), _t(5)),
        lambda p: p.reduce_scatter_tensor(torch.zeros(3), _t(6)),
        "expected world_size * out.numel() = 2 * 3 = 6",
    ),
    "unsupported device": (
        lambda p: p.broadcast(torch.ones(6, device="meta")),
        lambda p: p.broadcast(_t(6)),
        "tensor is on meta, which is not supported",
    ),
}


@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_every_kind_of_refusal_reaches_the_other_rank(transport: str) -> None:
    async with fg.testing.local_group(2, transport=transport, timeouts=SLOW) as peers:
        for name, (refused, matching, message) in CASES.items():
            start = time.monotonic()
            with pytest.raises((fg.ConfigError, TypeError)) as own:
                refused(peers[1])
            assert message.removeprefix("TypeError: ") in str(own.value), (name, own.value)
            with pytest.raises(fg.ConfigError) as other:
                await asyncio.wait_for(matching(peers[0]), 10)
            assert time.monotonic() - start < BAR_S, name
            _assert_names(other.value, 1, message)
            assert fg.testing.last_seq(peers[0]) == fg.testing.last_seq(peers[1]), name
        await _check_usable(peers, SMALL, 4)
        await _check_usable(peers, BIG, 5)


async def test_a_coalesced_call_refuses_as_many_collectives_as_it_would_run() -> None:
    async with fg.testing.local_group(2, transport="grpc", timeouts=SLOW) as peers:
        # Two dtypes: two collectives on rank 0; rank 1's second tensor
        # overlaps itself, so its call is refused, for both of them.
        good = [_t(4), _t(3, dtype=torch.float64)]
        bad = [_t(4), torch.zeros(1, dtype=torch.float64).expand(3)]
        with pytest.raises(fg.ConfigError, match=r"tensors\[1\]"):
            peers[1].all_reduce_coalesced(bad)
        with pytest.raises(fg.ConfigError, match="rank 1's own argument checks"):
            await asyncio.wait_for(peers[0].all_reduce_coalesced(good), 10)
        assert fg.testing.last_seq(peers[0]) == fg.testing.last_seq(peers[1])
        await _check_usable(peers, SMALL, 6)


async def test_a_call_refused_on_every_rank_keeps_the_group() -> None:
    async with fg.testing.local_group(3, transport="grpc", timeouts=SLOW) as peers:
        for p in peers:
            with pytest.raises(fg.ConfigError, match="MEAN is not defined") as own:
                p.all_reduce(_t(5, dtype=torch.int64), "mean")
            assert own.value.rank == p.rank, own.value  # its own error, not another's
        await _check_usable(peers, BIG, 7)


async def test_an_expanded_tensor_is_refused_before_anything_is_sent() -> None:
    # Before: the ring ran, then the copy back into the expanded tensor raised
    # torch's raw RuntimeError on one rank while the other succeeded.
    async with fg.testing.local_group(2, transport="grpc", timeouts=SLOW) as peers:
        before = [fg.testing.stats(p).bytes_sent for p in peers]
        for p in peers:
            with pytest.raises(fg.ConfigError, match="share memory"):
                p.all_reduce(torch.zeros(1, 1000).expand(300, 1000))
        assert [fg.testing.stats(p).bytes_sent for p in peers] == before
        await _check_usable(peers, SMALL, 8)


def test_a_refusal_mid_round_breaks_the_group_instead() -> None:
    # A refusal that stops a rank in the middle of a shared-memory round
    # (its host's ranks then disagree on which rounds ran) breaks the group
    # with the refusal as the cause; outside a round the plane survives.
    class Silent:
        async def ping(self, dst: int, timeout: float) -> None: ...

        async def send_abort(self, dst: int, message: bytes, timeout: float) -> None: ...

    async def go() -> None:
        policy = FailurePolicy(Identity(0, 2), Silent())
        refusal = FailurePolicy(Identity(1, 2), Silent()).refusal_error("all_reduce", 4, "bad")
        assert refusal.evidence is Evidence.REFUSED and refusal.peer == 1
        assert policy.plane_survives(refusal, mid_round=False)
        assert policy.broken is None
        other = fg.PeerError("gone", peer=1)
        assert not policy.plane_survives(other, mid_round=False)
        assert policy.broken is None
        assert not policy.plane_survives(refusal, mid_round=True)
        broken = policy.broken
        assert isinstance(broken, fg.ConfigError) and broken.peer == 1, broken
        assert "rank 1's own argument checks refused its call of all_reduce: bad" in str(broken)
        assert "the group is broken" in str(broken)

    asyncio.run(go())


@pytest.mark.timeout(120)
def test_a_refused_call_in_real_processes_fails_the_others_in_seconds(
    report: Callable[[str], None],
) -> None:
    # The repro through the blocking Backend: rank 1 asks for the
    # mean of an int tensor; rank 0 (default 300 s deadline) fails at once.
    with ServedJob(2) as job:
        assert job.command("all_reduce")[0].startswith("OK")
        start = time.monotonic()
        answers = job.send(["all_reduce_int sum", "all_reduce_int mean"])
        took = time.monotonic() - start
        assert answers[1].startswith("ConfigError [rank 1/2 all_reduce#"), answers
        assert "MEAN is not defined for integer dtype torch.int64" in answers[1], answers
        assert answers[0].startswith("ConfigError [rank 0/2 all_reduce#"), answers
        assert "peer 1" in answers[0] and "rank 1's own argument checks" in answers[0], answers
        assert "MEAN is not defined for integer dtype torch.int64" in answers[0], answers
        assert took < BAR_S, took
        report(f"refused call through the Backend (2 processes): rank 0 failed in {took:.2f} s")
        for answer in job.command("all_reduce"):
            word, error = answer.split()
            assert word == "OK" and float(error) < 1e-9, answers


# ------------------------------------------------------------ item 5


async def test_equal_counts_of_different_shapes_reduce_element_by_element() -> None:
    # Documented (README): ranks agree on element count, dtype and op, not
    # on shape, as with torch's gloo backend; a (2, 3) and a (3, 2) tensor
    # reduce as flat arrays in memory order.
    async with fg.testing.local_group(2, transport="grpc", timeouts=SLOW) as peers:
        a = torch.arange(6.0).reshape(2, 3)
        b = torch.arange(6.0).reshape(3, 2) * 10
        ref = reference_sum([a.flatten(), b.flatten()])
        await asyncio.gather(peers[0].all_reduce(a), peers[1].all_reduce(b))
        assert a.shape == (2, 3) and b.shape == (3, 2)
        torch.testing.assert_close(a.flatten().double(), ref)
        torch.testing.assert_close(b.flatten().double(), ref)


async def test_a_collective_cut_short_by_close_names_its_op_and_seq() -> None:
    async with fg.testing.local_group(2, transport="grpc", timeouts=SLOW) as peers:
        waiting = asyncio.ensure_future(peers[0].broadcast(torch.zeros(10), root=1))
        seq = fg.testing.last_seq(peers[0])
        deadline = time.monotonic() + 10
        while not fg.testing.running(peers[0], seq):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        await peers[0].close()
        with pytest.raises(fg.PeerError) as info:
            await waiting
        assert info.value.op == "broadcast" and info.value.seq == seq, info.value
        assert f"broadcast#{seq}" in str(info.value), info.value
        assert "the peer was closed while this collective ran" in str(info.value)
