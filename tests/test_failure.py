"""The failure policy (failure/policy.py) driven directly, with no live group: a dead
neighbour, a relayed report, a rank's own finding, a cancelled sibling and
a late report. And a lane run on the in-memory transport alone, without a
Peer."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ferrogrpc.algorithms.context import RankContext
from ferrogrpc.algorithms.descriptor import build_plans, make_descriptor
from ferrogrpc.algorithms.jobs import JobTable
from ferrogrpc.algorithms.mailboxes import Mailboxes
from ferrogrpc.algorithms.ring import LaneRunner
from ferrogrpc.errors import Evidence, FerroGrpcError, Identity, PeerError, ProtocolError
from ferrogrpc.failure import policy as failure_module
from ferrogrpc.failure.policy import FailurePolicy
from ferrogrpc.ops import ReduceOp
from ferrogrpc.options import Timeouts
from ferrogrpc.runtime.intake import Intake, Session
from ferrogrpc.transport.streams import MemoryTransport
from ferrogrpc.v1 import collective_pb2 as pb

pytestmark = pytest.mark.timeout(30)

ME = Identity(0, 4, ["h0:1", "h1:1", "h2:1", "h3:1"])


class FakeNotifier:
    """Ranks in ``alive`` answer pings; every abort sent is recorded."""

    def __init__(self, alive: set[int]) -> None:
        self.alive = alive
        self.aborts: list[tuple[int, pb.Abort]] = []

    async def ping(self, dst: int, timeout: float) -> None:
        if dst not in self.alive:
            raise PeerError(f"rank {dst} is gone", peer=dst, evidence=Evidence.UNREACHABLE)

    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None:
        self.aborts.append((dst, pb.Abort.FromString(message)))


def _policy(alive: set[int]) -> tuple[FailurePolicy, FakeNotifier, list[FerroGrpcError]]:
    notifier = FakeNotifier(alive)
    breaks: list[FerroGrpcError] = []
    policy = FailurePolicy(
        ME, notifier, nonce="n0", on_break=breaks.append, name_of=lambda seq: "all_reduce"
    )
    return policy, notifier, breaks


def _symptom(peer: int) -> PeerError:
    return PeerError(
        f"rank {peer} ended its stream after 1 of 6 chunks",
        peer=peer,
        evidence=Evidence.SYMPTOM,
    )


def _report(from_rank: int, culprit: int, seq: int = 7) -> pb.Abort:
    return pb.Abort(
        seq=seq,
        from_rank=from_rank,
        error="PeerError",
        message=f"rank {culprit} is gone",
        culprit=culprit,
    )


async def test_a_dead_neighbour_is_blamed_at_once_and_reported_to_everyone() -> None:
    policy, notifier, breaks = _policy(alive={2, 3})
    start = time.monotonic()
    err = await policy.settle(_symptom(1), "all_reduce", 7)
    assert time.monotonic() - start < 0.5  # the ping failed: no need to wait out the grace
    assert isinstance(err, PeerError) and err.peer == 1 and err.rank == 0 and err.seq == 7
    assert err.peer_address == "h1:1"
    assert breaks == [err] and policy.broken is err
    await policy.drain(1.0)
    assert sorted(dst for dst, _ in notifier.aborts) == [1, 2, 3]
    assert all(a.culprit == 1 and a.from_rank == 0 and a.nonce == "n0" for _, a in notifier.aborts)


async def test_a_relayed_report_beats_the_symptom_it_caused() -> None:
    policy, notifier, breaks = _policy(alive={1, 2, 3})

    async def report_later() -> None:
        await asyncio.sleep(0.1)
        policy.receive(_report(from_rank=2, culprit=3))

    reporter = asyncio.ensure_future(report_later())
    err = await policy.settle(_symptom(1), "all_reduce", 7)
    await reporter
    assert err.peer == 3 and "rank 2 reported" in err.message, err
    assert err.op == "all_reduce" and err.seq == 7
    # The report was received, not found here: nothing is broadcast.
    await policy.drain(1.0)
    assert notifier.aborts == [] and len(breaks) == 1


async def test_a_relayed_symptom_waits_for_the_cause_like_the_symptom_itself() -> None:
    # Rank 1 saw rank 2's stream end (a symptom) and told this rank in band,
    # before its own wait for the cause; rank 2, which found the cause
    # (rank 3's corrupted chunk), reports it a moment later. The relay of the
    # symptom must not beat the report of the cause.
    policy, _, _ = _policy(alive={1, 2, 3})
    sender = FailurePolicy(Identity(1, 4, ME.addresses), FakeNotifier(set()))
    relayed = policy.from_report(sender.abort_message(_symptom(2)))
    assert relayed.evidence is Evidence.SYMPTOM and relayed.peer == 2

    async def report_later() -> None:
        await asyncio.sleep(0.2)
        policy.receive(
            pb.Abort(seq=7, from_rank=2, error="ProtocolError", message="rank 3's chunk", culprit=3)
        )

    reporter = asyncio.ensure_future(report_later())
    err = await policy.settle(relayed, "all_reduce", 7)
    await reporter
    assert isinstance(err, ProtocolError) and err.peer == 3, err
    assert "rank 2 reported" in err.message, err
    # A report of a cause, in band, is still the cause at once.
    found = policy.from_report(sender.abort_message(ProtocolError("bad chunk", peer=3)))
    assert found.evidence is Evidence.RELAYED


async def test_a_ranks_own_finding_beats_a_relay_of_it_that_arrived_first() -> None:
    policy, _, _ = _policy(alive={1, 2, 3})
    policy.receive(_report(from_rank=2, culprit=1))
    own = ProtocolError("chunk 2 from rank 1 failed its crc32 check", peer=1)
    err = await policy.settle(own, "all_reduce", 7)
    assert isinstance(err, ProtocolError) and err.evidence is Evidence.FOUND
    assert "reported" not in err.message and err.peer == 1
    # A relayed account of another rank's finding does not win over it either
    # way: a later collective is told what broke the group.
    later = await policy.settle(_symptom(2), "broadcast", 8)
    assert "aborted because all_reduce#7 failed" in later.message, later


async def test_a_task_cancelled_for_its_siblings_failure_reports_that_failure() -> None:
    policy, _, _ = _policy(alive={1, 2, 3})
    sibling = PeerError("sending: rank 1 is gone", peer=1)
    cause = policy.cause(asyncio.CancelledError(), "all_reduce", 7, sibling)
    assert cause.peer == 1 and "rank 1 is gone" in str(cause) and cause.rank == 0
    assert "interrupted" not in str(cause)
    # In an exception group too, cancellations are skipped.
    group = BaseExceptionGroup("lanes", [asyncio.CancelledError(), sibling])
    assert policy.cause(group, "all_reduce", 7).peer == 1
    # No sibling and not broken: the interruption itself.
    assert "interrupted" in str(policy.cause(asyncio.CancelledError(), "all_reduce", 7))


@pytest.mark.parametrize("late_by", [0.3, 0.6])
async def test_a_late_report_from_a_live_neighbour(
    late_by: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The named neighbour answers its ping, so its report is given up to
    # twice the grace: one landing after 1.5 graces wins, one after 3 graces
    # is too late and the symptom stands.
    monkeypatch.setattr(failure_module, "ECHO_GRACE_S", 0.2)
    policy, _, _ = _policy(alive={1, 2, 3})

    async def report_later() -> None:
        await asyncio.sleep(late_by)
        policy.receive(_report(from_rank=1, culprit=2))

    reporter = asyncio.ensure_future(report_later())
    err = await policy.settle(_symptom(1), "all_reduce", 7)
    await reporter
    if late_by < 0.4:
        assert err.peer == 2 and "rank 1 reported" in err.message, err
    else:
        assert err.peer == 1 and err.evidence is Evidence.SYMPTOM, err


async def test_a_lane_runs_on_the_memory_transport_without_a_peer() -> None:
    world = 3
    registry: dict[str, MemoryTransport] = {}
    transports = [MemoryTransport(registry) for _ in range(world)]
    mailboxes = [Mailboxes() for _ in range(world)]
    intakes = [Intake(m) for m in mailboxes]
    addresses = [await t.start(i) for t, i in zip(transports, intakes, strict=True)]
    timeouts = Timeouts(collective=10, idle=5, connect=5)
    contexts = []
    for rank in range(world):
        me = Identity(rank, world, addresses)
        jobs = JobTable(world)
        policy = FailurePolicy(me, transports[rank], on_break=jobs.cancel_all)
        intakes[rank].open(Session(rank, world, [], jobs, policy, linger=10))
        transports[rank].connect(addresses)
        contexts.append(
            (RankContext(me, transports[rank], mailboxes[rank], policy, timeouts, None), jobs)
        )
    inputs = [torch.randn(1001, dtype=torch.float64) for _ in range(world)]
    tensors = [t.clone() for t in inputs]
    runners = []
    for rank, (ctx, jobs) in enumerate(contexts):
        desc = make_descriptor(
            pb.ALL_REDUCE, tensors[rank], ReduceOp.SUM, 0, world, (128, 1), 1 << 20, None
        )
        job = jobs.add("all_reduce", desc, tensors[rank])
        runners.append(LaneRunner(ctx, job, 0, build_plans(desc, rank, world)[0]))
    await asyncio.gather(*(r.run() for r in runners))
    expected = torch.stack(inputs).sum(0)
    for t in tensors:
        torch.testing.assert_close(t, expected)
    # A rank whose descriptor disagrees (another op) fails, naming both ranks.
    for rank, (ctx, jobs) in enumerate(contexts):
        op = ReduceOp.MAX if rank == 1 else ReduceOp.SUM
        desc = make_descriptor(pb.ALL_REDUCE, tensors[rank], op, 0, world, (128, 1), 1 << 20, None)
        job = jobs.add("all_reduce", desc, tensors[rank], op)
        runners[rank] = LaneRunner(ctx, job, 0, build_plans(desc, rank, world)[0])
    results = await asyncio.gather(*(r.run() for r in runners), return_exceptions=True)
    found = results[2]
    assert isinstance(found, BaseExceptionGroup), results
    assert isinstance(found.exceptions[0], ProtocolError), results
    assert "rank 2 has reduce_op=sum, rank 1 has reduce_op=max" in str(found.exceptions[0])


async def test_a_peer_found_unreachable_is_not_sent_the_abort() -> None:
    # Its process or host is gone: a notice could only wait out its timeout,
    # and hold up close() by as much. Every other rank is told.
    policy, notifier, _ = _policy(alive={1, 3})
    gone = PeerError("rank 2 cannot be reached", peer=2, evidence=Evidence.UNREACHABLE)
    policy.declare(ME.stamp(gone, "all_reduce", 7), broadcast=True)
    await policy.drain(2.0)
    assert sorted(dst for dst, _ in notifier.aborts) == [1, 3], notifier.aborts
    # A rank named for anything else is told like the others.
    policy, notifier, _ = _policy(alive={1, 2, 3})
    found = ProtocolError("rank 2 sent a corrupt chunk", peer=2)
    policy.declare(ME.stamp(found, "all_reduce", 8), broadcast=True)
    await policy.drain(2.0)
    assert sorted(dst for dst, _ in notifier.aborts) == [1, 2, 3], notifier.aborts
