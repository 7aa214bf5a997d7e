"""Elastic training (issue 30): the coordinator's membership on its own
(a fake clock), then real processes: a rank killed before its forward or
halfway through backward, a joiner, a stall, a lost quorum and a restarted
coordinator. The reference is single-process training on the slices that
actually contributed to each step (``tests/ranks/elastic_train.py``)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from torch import nn

import ferrogrpc as fg
from ferrogrpc.control.membership import ElasticMembership
from ferrogrpc.control.rounds import QuorumLostInRound
from ferrogrpc.elastic.state import _messages, _stripes
from ferrogrpc.v1 import rendezvous_pb2 as rpb
from tests.helpers import async_wait_until

from .helpers import RANKS, ROOT, Forked, free_port, on_ranks, spawn_rank

sys.path.insert(0, str(RANKS))
import elastic_train

HEARTBEAT_S = 2.0

# ------------------------------------------------ the membership, on its own


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _enter(m: ElasticMembership, peer: str, reason: int, epoch: int, lost: list[int] = []) -> Any:  # noqa: B006
    request = rpb.EnterRequest(
        peer_id=peer, address=f"{peer}:1", nonce="n" * 16, epoch=epoch, reason=reason, lost=lost
    )
    return asyncio.ensure_future(m.enter(request))


def _placed(answers: list[Any]) -> list[tuple[int, int, int, int]]:
    """Each answer's (epoch, rank, world size, joined_from)."""
    return [(r.epoch, r.rank, r.world_size, r.joined_from) for r in answers]


async def _first(m: ElasticMembership, peers: list[str]) -> list[Any]:
    entered = [_enter(m, p, rpb.ENTER_JOIN, 0) for p in peers]
    return list(await asyncio.gather(*entered))


@pytest.mark.timeout(30)
async def test_membership_recover_drops_the_lost_and_renumbers_in_the_old_order() -> None:
    m = ElasticMembership(heartbeat_timeout=2.0, join_window=0.1, initial_world_size=4, quiet=0)
    first = await _first(m, ["a", "b", "c", "d"])
    assert _placed(first) == [(1, i, 4, 4) for i in range(4)]
    # A sync committed by three of four, then rank 1 is reported lost:
    # the pending commits are refused (the sync is redone), never granted.
    commits = [
        asyncio.ensure_future(m.commit(rpb.CommitRequest(peer_id=p, epoch=1, n=0)))
        for p in ("a", "c", "d")
    ]
    await asyncio.sleep(0)
    assert not any(c.done() for c in commits)
    survivors = [_enter(m, p, rpb.ENTER_RECOVER, 1, [1]) for p in ("d", "a", "c")]
    answers = await asyncio.gather(*survivors)
    assert [await c for c in commits] == [False, False, False]
    assert [(r.epoch, r.world_size, r.rank) for r in answers] == [(2, 3, 2), (2, 3, 0), (2, 3, 1)]
    assert list(answers[0].addresses) == ["a:1", "c:1", "d:1"]
    # Every member's commit of a sync: granted.
    grant = [
        asyncio.ensure_future(m.commit(rpb.CommitRequest(peer_id=p, epoch=2, n=0)))
        for p in ("a", "c", "d")
    ]
    assert await asyncio.gather(*grant) == [True, True, True]


@pytest.mark.timeout(30)
async def test_membership_admits_joiners_only_at_a_grow_and_fails_below_quorum() -> None:
    clock = Clock()
    m = ElasticMembership(
        heartbeat_timeout=2.0, join_window=0.1, min_world_size=2, clock=clock, quiet=0
    )
    m.initial_world_size = 2
    await _first(m, ["a", "b"])
    joiner = _enter(m, "j", rpb.ENTER_JOIN, 0)
    await asyncio.sleep(0.01)
    assert not joiner.done()
    beat = m.heartbeat(rpb.HeartbeatRequest(peer_id="a", epoch=1, rank=0, address="a:1"))
    assert beat.joiners_waiting == 1 and beat.member
    # Where the joiner's next epoch listens: members connect to it ahead
    # (see [Note: connecting ahead]).
    assert list(beat.joiner_addresses) == ["j:1"]
    grow = [_enter(m, p, rpb.ENTER_GROW, 1) for p in ("a", "b")]
    answers = await asyncio.gather(joiner, *grow)
    assert _placed(answers) == [
        (2, 2, 3, 2),
        (2, 0, 3, 2),
        (2, 1, 3, 2),
    ]
    # b and j go silent: the coordinator removes them, and one member
    # is below min_world_size 2: quorum lost, naming both.
    clock.now += 1.0
    beat = m.heartbeat(rpb.HeartbeatRequest(peer_id="a", epoch=2, rank=0, address="a:1"))
    assert list(beat.joiner_addresses) == []  # admitted: none waits
    clock.now += 1.5
    m.check_silence()
    assert m.round is None and m.epoch == 0  # the group is over
    # a learns it when it enters next, whatever it reports.
    with pytest.raises(QuorumLostInRound) as caught:
        await _enter(m, "a", rpb.ENTER_RECOVER, 2, [1])
    assert caught.value.lost == [1, 2]


@pytest.mark.timeout(30)
async def test_a_member_entering_as_a_joiner_is_never_kept_without_the_state() -> None:
    # A member of epoch 1 that enters as a joiner (removed, or its receipt
    # of the state failed) lacks the state: a RECOVER goes on without it
    # (naming its rank dropped); the next GROW admits it among the joiners,
    # so that the members send it the state.
    m = ElasticMembership(heartbeat_timeout=2.0, join_window=0.1, initial_world_size=3, quiet=0)
    await _first(m, ["a", "b", "c"])
    rejoin = _enter(m, "b", rpb.ENTER_JOIN, 1)
    await asyncio.sleep(0.01)
    recover = await asyncio.gather(*(_enter(m, p, rpb.ENTER_RECOVER, 1) for p in ("a", "c")))
    assert _placed(recover) == [
        (2, 0, 2, 2),
        (2, 1, 2, 2),
    ]
    assert not rejoin.done() and m.removed_total == 1
    grow = [_enter(m, p, rpb.ENTER_GROW, 2) for p in ("c", "a")]
    answers = await asyncio.gather(rejoin, *grow)
    assert _placed(answers) == [
        (3, 2, 3, 2),
        (3, 1, 3, 2),
        (3, 0, 3, 2),
    ]
    # A restarted coordinator that has not placed a member yet (no
    # heartbeat from it) lets it wait when it enters to recover, never as a
    # joiner; once placed, it is kept (it has the state).
    r = ElasticMembership(heartbeat_timeout=2.0, join_window=0.1)
    r.heartbeat(rpb.HeartbeatRequest(peer_id="a", epoch=7, rank=0, world_size=3, address="a:1"))
    early = _enter(r, "c", rpb.ENTER_RECOVER, 7, [1])
    await asyncio.sleep(0.01)
    assert not early.done() and "c" not in r.joiners
    r.heartbeat(rpb.HeartbeatRequest(peer_id="c", epoch=7, rank=2, world_size=3, address="c:1"))
    answers = await asyncio.gather(early, _enter(r, "a", rpb.ENTER_RECOVER, 7, [1]))
    assert [(a.epoch, a.rank, a.world_size, a.joined_from) for a in answers] == [
        (8, 1, 2, 2),
        (8, 0, 2, 2),
    ]
    # A member that enters as a joiner once a GROW is open (its kept place
    # taken already) moves to the joiners' part of it.
    grow = [_enter(m, p, rpb.ENTER_GROW, 3) for p in ("a",)]
    await asyncio.sleep(0.01)
    assert m.round is not None and m.round.order == ["a", "c", "b"]
    late = _enter(m, "c", rpb.ENTER_JOIN, 3)
    answers = await asyncio.gather(late, *grow, _enter(m, "b", rpb.ENTER_GROW, 3))
    assert [(r.epoch, r.rank, r.joined_from) for r in answers] == [(4, 2, 2), (4, 0, 2), (4, 1, 2)]


@pytest.mark.timeout(30)
async def test_a_restarted_coordinator_adopts_the_epoch_and_a_stale_one_is_not() -> None:
    m = ElasticMembership(heartbeat_timeout=2.0, join_window=0.1)
    for rank, peer in enumerate(("a", "b", "c")):
        beat = m.heartbeat(
            rpb.HeartbeatRequest(
                peer_id=peer, epoch=7, rank=rank, world_size=3, address=f"{peer}:1"
            )
        )
        assert beat.member and beat.epoch == 7
    assert m.members == ["a", "b", "c"]
    answers = await asyncio.gather(*(_enter(m, p, rpb.ENTER_RECOVER, 7, [1]) for p in ("a", "c")))
    assert [(r.epoch, r.rank, r.world_size) for r in answers] == [(8, 0, 2), (8, 1, 2)]
    # Both leave: the group is over; b, woken late with epoch 7, is not
    # taken for a group to adopt.
    for p in ("a", "c"):
        m.heartbeat(rpb.HeartbeatRequest(peer_id=p, epoch=8, leaving=True))
    assert m.epoch == 0
    late = m.heartbeat(rpb.HeartbeatRequest(peer_id="b", epoch=7, rank=1, address="b:1"))
    assert not late.member and m.epoch == 0


def test_the_stripes_cover_every_byte_once() -> None:
    sizes = [3, 5 * 2**20, 0, 17, 40 * 2**20, 1, 2**20]
    total = sum(sizes)
    for members in (1, 2, 3, 5):
        seen = [0] * len(sizes)
        last = 0
        for lo, hi in _stripes(total, members):
            assert lo == last
            last = hi
            for message in _messages(sizes, lo, hi):
                assert sum(s.hi - s.lo for s in message) <= 32 * 2**20
                for seg in message:
                    seen[seg.tensor] += seg.hi - seg.lo
        assert last == total and seen == sizes


def test_an_optimizer_step_lets_a_transfer_in_flight_end_first() -> None:
    """A step with no gradient sync (which would finish the transfer)
    still must not change the optimizer's tensors while a member sends them
    to a joiner: ElasticState's step pre-hook waits for the sends first. A
    send that failed is left to the next sync or boundary."""
    from ferrogrpc.elastic.backend import ElasticBackend
    from ferrogrpc.elastic.state import ElasticState

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    member = ElasticBackend.__new__(ElasticBackend)
    member._current = object()  # type: ignore[assignment]  # a member, not a joiner
    member._stateless = False
    member.resharders = []

    class Wrapper:  # what ElasticState reads of fg.DDP
        backend = member
        module = model

        def broadcast_parameters(self) -> None: ...

    state = ElasticState(Wrapper(), opt)  # type: ignore[arg-type]
    seen: list[torch.Tensor] = []

    class Sending:  # a member's send of a tensor the step will change
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def wait(self) -> None:
            seen.append(model.weight.detach().clone())
            if self.fails:
                raise fg.PeerError("the joiner is gone", op="send")

    for fails in (False, True):
        before = model.weight.detach().clone()
        state._sending = [Sending(fails)]  # type: ignore[list-item]
        model(torch.ones(1, 4)).sum().backward()
        opt.step()  # no error: a failed send is the next sync's to handle
        assert torch.equal(seen[-1], before)  # sent before the step changed it
        assert not torch.equal(model.weight, before) and state._sending == []
    opt.step()  # nothing in flight: the hook does nothing
    assert len(seen) == 2


def test_a_boundary_the_group_agreed_it_is_past_costs_no_collective() -> None:
    """A member of an elastic FSDP group voided its step in the sync (the
    position it gave the new epoch: 2 x step + 1) while another, whose
    boundary collective the lost rank had not reached, was still at that
    step's boundary (2 x step): the group agreed it is inside the step, so
    the second returned from its boundary and runs the step. The first
    re-runs the void step from ``steps()``, through the boundary: there it
    must not run the boundary's collective, which the second does not. CI
    once saw the two swap places at every epoch, forever (290 epochs in 25
    s, no step)."""
    import threading

    from ferrogrpc.elastic.backend import ElasticBackend
    from ferrogrpc.elastic.progress import Progress
    from ferrogrpc.env import Settings

    calls: list[str] = []

    class Life:
        broken = None

    class Current:  # the epoch's Backend, as far as the boundary reads it
        rank, data_path, world_size = 0, "grpc", 2

        class peer:  # noqa: N801
            _life = Life()

            @staticmethod
            def _set_stamp(stamp: int) -> None: ...

        def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
            calls.append("all_reduce")

    class Client:
        latest = None

    backend = ElasticBackend.__new__(ElasticBackend)
    backend._current = Current()  # type: ignore[assignment]
    backend._stateless = False
    backend._s = Settings.from_env({}).merged(shm=False)
    backend.state = None
    backend._lock = threading.Lock()
    backend._removed_me, backend._removed_ranks = False, []
    backend._client = Client()  # type: ignore[assignment]
    backend._epoch, backend._stamped = 3, True
    backend._last_target = 2 * 7 + 1  # the group: inside step 7's sync
    backend._progress = Progress()
    backend._progress.changes = 3
    backend._void_step = 7  # (run_sync: FSDP's step 7 was void here)
    assert backend.boundary(7) is False
    assert calls == []  # the void step 7 re-runs without the boundary's collective
    assert backend._progress.changes == 3  # (no step made yet)
    assert backend.boundary(8) is False
    assert calls == ["all_reduce"]  # the next boundary is everyone's
    assert backend._progress.changes == 0  # a boundary passed: progress
    # A process whose step was not void here (DDP redoes its sync instead)
    # keeps the boundary's collective, as before.
    backend._void_step, backend._last_target = -1, 2 * 9 + 1
    assert backend.boundary(9) is False
    assert calls == ["all_reduce", "all_reduce"]


def test_a_member_placed_as_a_joiner_by_its_own_grow_takes_the_groups_step() -> None:
    """A member at a boundary that admits a joiner enters the GROW epoch;
    if it was removed meanwhile (a stall, or its peer could not start in
    the epoch before), the coordinator places it among the joiners, and
    its settle receives the group's state and step. The boundary must then
    say so, so that ``steps()`` yields the group's step, not this
    process's. CI's chaos test saw the process train its own step 17 with
    the group at step 20 (stamped 20, so its collectives matched): a
    slice of another step's batch in the group's mean, silently."""
    import threading

    from ferrogrpc.elastic.backend import ElasticBackend
    from ferrogrpc.elastic.progress import Progress
    from ferrogrpc.env import Settings

    class Life:
        broken = None

    class Current:
        rank, data_path, world_size = 0, "grpc", 3

        class peer:  # noqa: N801
            _life = Life()

            @staticmethod
            def _set_stamp(stamp: int) -> None: ...

        def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
            tensor.fill_(int(self.world_size == 3))  # joiners wait, then none

    class Client:
        latest = None

    backend = ElasticBackend.__new__(ElasticBackend)
    backend._current = Current()  # type: ignore[assignment]
    backend._stateless = False
    backend._s = Settings.from_env({}).merged(shm=False)
    backend.state = None
    backend._lock = threading.Lock()
    backend._removed_me, backend._removed_ranks = False, []
    backend._client = Client()  # type: ignore[assignment]
    backend._epoch, backend._stamped = 3, True
    backend._last_target, backend._void_step, backend._progress = 0, -1, Progress()

    def enter(reason: int) -> None:  # placed as a joiner: rank 3, joined from 3
        placed = Current()
        placed.rank, placed.world_size = 3, 4
        backend._current, backend._joined_from = placed, 3  # type: ignore[assignment]

    def settle() -> int:  # received the group's state: its step is 20
        backend._step = 20
        return 2 * 20

    backend._enter = enter  # type: ignore[method-assign, assignment]
    backend._settle = settle  # type: ignore[method-assign]
    assert backend.boundary(17) is True  # steps() takes ElasticState.step (20)


def test_epoch_changes_without_a_step_end_in_an_error_naming_the_livelock() -> None:
    """The guard behind the fix above: a member whose group changes epoch
    FRUITLESS_CHANGES times in a row with no step completed between (each
    recovery itself succeeding) raises a ProtocolError saying so, instead
    of changing again forever; a completed step resets the count."""
    from ferrogrpc.elastic.backend import ElasticBackend
    from ferrogrpc.elastic.progress import FRUITLESS_CHANGES, Progress

    backend = ElasticBackend.__new__(ElasticBackend)
    backend._current, backend._stateless = None, True  # (its rank: -1)
    backend._progress = Progress()
    recoveries: list[int] = []
    backend._recover_once = lambda cause: recoveries.append(1) is None and False  # type: ignore[method-assign]
    cause = fg.ProtocolError("ranks disagree on kind", rank=0, op="all_reduce")
    for _ in range(FRUITLESS_CHANGES):
        assert backend.recover(cause) is False
    backend._progress.made()  # a step completed: the count starts again
    for _ in range(FRUITLESS_CHANGES):
        backend.recover(cause)
    with pytest.raises(fg.ProtocolError) as caught:
        backend.recover(cause)
    assert len(recoveries) == 2 * FRUITLESS_CHANGES  # the last one never ran
    assert f"changed epoch {FRUITLESS_CHANGES} times in a row" in str(caught.value)
    assert "ranks disagree on kind" in str(caught.value)


def test_a_spare_segment_is_made_where_the_next_epoch_may_share_the_host() -> None:
    """[Note: a segment made ahead]: a joiner, a member whose epoch has
    ranks on its host, and a lone member (its next epoch admits a joiner,
    perhaps a process restarted beside it) have the next epoch's segment
    made ahead, a joiner the one after too (it has none to hand back); a
    member of a group spread one rank a host does not, and drops what it
    holds; nor does any process with shared memory off."""
    from ferrogrpc.elastic.backend import ElasticBackend
    from ferrogrpc.env import Settings

    class Current:
        def __init__(self, data_path: str, world_size: int) -> None:
            self.data_path, self.world_size = data_path, world_size

    from ferrogrpc.samehost import segment

    class Spare:
        # The rule under test; what it asks for is recorded.
        prepare_next = segment.Spare.prepare_next

        def __init__(self) -> None:
            self.prepared: list[int] = []

        def prepare(self, nbytes: int, count: int = 1) -> None:
            self.prepared.append(count)

        def drop(self) -> None:
            self.prepared.append(0)

    cases = [
        (True, None, [2]),  # a joiner: its next epoch's and the one after
        (True, Current("shared memory", 3), [1]),
        (True, Current("two-level", 4), [1]),
        (True, Current("grpc", 1), [1]),  # a lone member
        (True, Current("grpc", 3), [0]),  # one rank a host: drops what it holds
        (False, None, []),
        (False, Current("shared memory", 3), []),
    ]
    for shm, current, made in cases:
        backend = ElasticBackend.__new__(ElasticBackend)
        backend._s = Settings.from_env({}).merged(shm=shm)
        backend._current = current  # type: ignore[assignment]
        backend._spare = Spare()  # type: ignore[assignment]
        backend._prepare_spare()
        assert backend._spare.prepared == made, (shm, current and vars(current))


@pytest.mark.timeout(30)
async def test_members_connect_ahead_to_the_joiners_that_wait() -> None:
    """[Note: connecting ahead]: a member opens a channel to each joiner its
    heartbeat names, connected before any call; the next epoch's transport
    takes it as lane 0's to that address, and closes those it did not take;
    a channel to a joiner that no longer waits is closed."""
    from ferrogrpc.runtime.join import Ahead
    from ferrogrpc.samehost.segment import Spare
    from ferrogrpc.transport.grpc_streams import GrpcTransport

    servers, addresses = [], []
    for _ in range(2):  # two joiners' servers, listening
        server = grpc.aio.server()
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    member = GrpcTransport()
    ahead = Ahead(Spare())
    try:
        ahead.connect(member, addresses)
        first, second = (ahead.channels[a] for a in addresses)
        ready = grpc.ChannelConnectivity.READY
        await async_wait_until(  # with no call made, nor a connection asked for since
            lambda: first.get_state() is ready and second.get_state() is ready, 10, "connected"
        )
        ahead.connect(member, addresses)
        assert ahead.channels == {addresses[0]: first, addresses[1]: second}
        ahead.connect(member, addresses[:1])
        assert ahead.channels == {addresses[0]: first}
        await asyncio.gather(*ahead._closing)
        assert second.get_state() is grpc.ChannelConnectivity.SHUTDOWN

        ahead.connect(member, addresses)
        third = ahead.channels[addresses[1]]
        following = GrpcTransport(ahead=ahead.take_channels())
        following.connect(["127.0.0.1:1", addresses[0]])
        assert ahead.channels == {}
        assert following._channel(1, 0) is first
        assert following._channel(1, 1) is not first  # another lane: its own
        await following.close()
        for channel in (first, third):
            assert channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN
    finally:
        await member.close()
        for server in servers:
            await server.stop(None)


@pytest.mark.timeout(30)
async def test_the_next_epoch_forms_while_the_last_one_closes() -> None:
    """An elastic member enters the next epoch while its last peer still
    closes (Ahead.closing): its rendezvous does not wait for that close,
    and the new peer is built only once the close is done."""
    from ferrogrpc.control.rendezvous import RendezvousResult
    from ferrogrpc.env import Settings
    from ferrogrpc.runtime.join import Ahead
    from ferrogrpc.runtime.peer import Peer
    from ferrogrpc.samehost.segment import Spare

    loop = asyncio.get_running_loop()
    closing: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    class Rendezvous:
        async def exchange(self, rank: Any, world: Any, address: str, nonce: str, host: str = ""):  # type: ignore[no-untyped-def]
            seen.append("exchange, closed" if closing.done() else "exchange, closing")
            loop.call_later(0.05, lambda: (seen.append("closed"), closing.set_result(None)))
            return RendezvousResult(0, 1, [address], [nonce])

        def start_heartbeats(self, activity: Any) -> None:
            pass

        async def close(self) -> None:
            pass

    ahead = Ahead(Spare(), closing=closing)
    peer = await Peer.start(
        None, None, rendezvous=Rendezvous(), settings=Settings.from_env({}), ahead=ahead
    )
    try:
        assert seen == ["exchange, closing", "closed"] and ahead.closing is None
    finally:
        await peer.close()
        ahead.spare.close()

    failed: asyncio.Future[None] = loop.create_future()
    failed.set_exception(RuntimeError("the close failed"))
    with pytest.raises(RuntimeError, match="the close failed"):
        await Ahead(Spare(), closing=failed).last_closed()


# ------------------------------------------------------- refusals, at once


def test_elastic_needs_a_coordinator() -> None:
    # (FSDP in an elastic group: tests/test_elastic_fsdp.py.)
    with pytest.raises(fg.ConfigError, match="coordinator"):
        fg.init_backend(elastic=True)


def test_the_torch_backend_refuses_an_elastic_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch calls this hook from init_process_group("ferrogrpc"); with
    # FERROGRPC_ELASTIC set it refuses before it touches the store.
    from types import SimpleNamespace

    from ferrogrpc.wrappers.process_group import create

    monkeypatch.setenv("FERROGRPC_ELASTIC", "1")
    opts = SimpleNamespace(store=None, group_rank=0, group_size=2)
    with pytest.raises(fg.ConfigError, match="does not support elastic groups"):
        create(opts, None)


# ------------------------------------------------------ real processes


class Run:
    """A coordinator and elastic_train.py processes; their JSON lines."""

    def __init__(self, tmp: Path, world: int, **env: str) -> None:
        self.tmp = tmp
        self.world = world
        self.port = free_port()
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "FERROGRPC_COORDINATOR": f"127.0.0.1:{self.port}",
            "FERROGRPC_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S),
            "OUT_DIR": str(tmp),
            "WORLD": str(world),
            **env,
        }
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.procs: list[Forked] = []
        self.start_coordinator()
        for _ in range(world):
            self.start_rank()

    def start_coordinator(self) -> None:
        n = len(glob.glob(str(self.tmp / "coordinator*.log")))
        self.coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(self.world)),
                *("--host", "127.0.0.1", "--port", str(self.port)),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=open(self.tmp / f"coordinator{n}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

    def start_rank(self) -> Forked:
        # A fork of the tests' zygote, which imported torch already.
        proc = spawn_rank("elastic_train.py", env=self.env)
        self.procs.append(proc)
        return proc

    def lines(self, n: int | None = None) -> list[dict[str, Any]]:
        out = []
        for i in [n] if n is not None else range(len(self.procs)):
            text = self.procs[i].stdout
            complete = text[: text.rfind("\n") + 1]  # not a line still being written
            for line in complete.splitlines():
                if line.startswith("{"):
                    d = json.loads(line)
                    d["proc"] = i
                    out.append(d)
        return out

    def output(self) -> str:
        ranks = [f"--- rank process {i}\n{p.stdout[-3000:]}" for i, p in enumerate(self.procs)]
        files = [
            f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
            for f in sorted(self.tmp.glob("*.log"))
        ]
        return "\n".join(files + ranks)

    def wait_for(self, what: Callable[[], Any], timeout: float, why: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"{why} within {timeout}s\n{self.output()}")

    def end_soon(self, ahead: int = 5) -> int:
        """End the run ``ahead`` steps after the last one printed, instead
        of at STEPS (elastic_train.py's END_FILE, which the run's
        environment must name): call it once every process still running
        trains, none waiting to join. Returns the steps the run will have."""
        end = len({d["step"] for d in self.lines() if "idx" in d}) + ahead
        elastic_train.write_end(self.env["END_FILE"], end)
        return end

    def finish(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"a rank did not finish\n{self.output()}") from None
        finally:
            self.close()
        return [p.returncode for p in self.procs]

    def close(self) -> None:
        for p in [*self.procs, self.coordinator]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def check_training(run: Run, steps: int) -> dict[int, list[dict[str, Any]]]:
    """Every step kept once, its contributors agreeing on the world size,
    and every final model bitwise equal and within 1e-6 of single-process
    training on the slices that contributed."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in run.lines():
        if "step" in d and "idx" in d:
            by_step.setdefault(d["step"], []).append(d)
    assert sorted(by_step) == list(range(steps)), (sorted(by_step), run.output())
    net = elastic_train.model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for step in range(steps):
        lines = by_step[step]
        worlds = {d["world"] for d in lines}
        assert worlds == {len(lines)}, (step, lines)
        assert len({json.dumps(d["idx"]) for d in lines}) == len(lines), (step, lines)
        replay_step(net, opt, step, lines)
    check_finals(run, steps, net)
    return by_step


def replay_step(
    net: nn.Module, opt: torch.optim.Optimizer, step: int, lines: list[dict[str, Any]]
) -> None:
    """Single-process training's ``step`` on the slices its lines name, in
    the model's dtype."""
    dtype = next(net.parameters()).dtype
    x, y = elastic_train.data(step)
    x, y = x.to(dtype), y.to(dtype)
    for group in opt.param_groups:
        group["lr"] = elastic_train.lr_at(step)
    opt.zero_grad()
    loss = sum(nn.functional.mse_loss(net(x[d["idx"]]), y[d["idx"]]) for d in lines)
    (loss / len(lines)).backward()  # type: ignore[operator]
    opt.step()


def check_finals(run: Run, steps: int, net: nn.Module) -> None:
    """Every saved final model at ``steps``, bitwise equal to the others and
    within 1e-6 of ``net`` (the replay)."""
    finals = [torch.load(f) for f in sorted(run.tmp.glob("final-*.pt"))]
    assert finals, run.output()
    for final in finals:
        assert final["step"] == steps
        for mine, first in zip(final["params"], finals[0]["params"], strict=True):
            assert torch.equal(mine, first)
        for mine, ref in zip(final["params"], net.parameters(), strict=True):
            torch.testing.assert_close(mine, ref.detach(), atol=1e-6, rtol=0)


@pytest.mark.timeout(150)
def test_killed_ranks_lose_no_step_and_joiners_get_live_state(
    tmp_path: Path, report: Callable[[str], None]
) -> None:
    # Rank 1 killed before its forward at step 4; a replacement joins; then
    # rank 2 killed halfway through backward, buckets in flight; another
    # replacement joins.
    steps = 60
    kill_file = tmp_path / "kill-again"
    run = Run(
        tmp_path,
        4,
        STEPS=str(steps),
        KILL_STEP="4",
        KILL_RANK="1",
        KILL_AT="before",
        KILL_FILE=str(kill_file),
        FILE_KILL_RANK="2",
        FILE_KILL_AT="backward",
        SLOW="0.2",
    )
    kills: list[dict[str, Any]] = []
    joiners: list[int] = []
    try:
        for round_ in range(2):

            def killed(n: int = round_) -> list[dict[str, Any]]:
                return [d for d in run.lines() if d.get("event") == "kill"][n:]

            kills.append(run.wait_for(killed, 60, f"no kill {round_ + 1}")[0])
            run.wait_for(
                lambda n=round_: sum(p.poll() == -signal.SIGKILL for p in run.procs) > n,
                10,
                "no death",
            )
            run.start_rank()
            joiners.append(len(run.procs) - 1)
            if round_ == 0:
                run.wait_for(
                    lambda: [d for d in run.lines(joiners[0]) if "idx" in d], 60, "no join"
                )
                kill_file.touch()
        codes = run.finish(90)
    finally:
        run.close()
    assert codes.count(-signal.SIGKILL) == 2 and codes.count(0) == 4, (codes, run.output())
    by_step = check_training(run, steps)
    for kill, what in zip(kills, ("before the forward", "mid-backward"), strict=True):
        # The kill step: the three survivors' slices of the four, no more.
        step = max(d["step"] for d in run.lines(kill["proc"]) if "idx" in d) + 1
        assert len(by_step[step]) == 3 and all(d["world"] == 3 for d in by_step[step])
        assert kill["proc"] not in {d["proc"] for d in by_step[step]}
        done = max(d["t"] for d in by_step[step])
        step_time = max(d["t"] for d in by_step[step - 1]) - max(d["t"] for d in by_step[step - 2])
        report(
            f"elastic, SIGKILL {what}: survivors finished that step "
            f"{done - kill['t']:.2f}s after the death (step time {step_time:.2f}s)"
        )
        assert done - kill["t"] <= step_time + 1.0, (done - kill["t"], step_time)
    for joiner in joiners:
        # A joiner's first step is the group's current one; it ran to the end.
        mine = [d for d in run.lines(joiner) if "idx" in d]
        assert mine and mine[-1]["step"] == steps - 1, run.output()
        assert mine[0]["world"] == 4 and mine[0]["extra"]["tag"] == "elastic-test"
        # It had the group's extra (and optimizer settings) as its first
        # step began, not only after that step's sync.
        assert mine[0]["extra_before"] == {"tag": "elastic-test", "last": mine[0]["step"] - 1}
        # Its first step ran while the optimizer's part of the state still
        # landed, and so did the members' step beside it: nobody waited for
        # the whole transfer at the boundary.
        assert mine[0]["in_flight"], mine[0]
        beside = [d for d in by_step[mine[0]["step"]] if d["proc"] != joiner]
        assert beside and all(d["in_flight"] for d in beside), beside


@pytest.mark.timeout(120)
def test_a_member_lost_while_it_sends_a_joiner_the_state(tmp_path: Path) -> None:
    # Rank 1 killed at step 4; a replacement joins; as the members send it
    # the state, rank 1 of that epoch dies with the optimizer's part of its
    # stripe (2 x 16 MB of padding's moments over three members) just
    # posted. The joiner's receipt is lost with it: it must join again and
    # receive the whole state from the two left, and no step may be lost
    # or doubled.
    steps = 24
    kill_file = tmp_path / "kill-while-sending"
    kill_file.touch()
    run = Run(
        tmp_path,
        4,
        STEPS=str(steps),
        KILL_STEP="4",
        KILL_RANK="1",
        TRANSFER_KILL_RANK="1",
        TRANSFER_KILL_FILE=str(kill_file),
        PAD_MB="16",
        FERROGRPC_SHM="0",  # the state over gRPC, as between hosts
        SLOW="0.2",
    )
    try:
        run.wait_for(lambda: [d for d in run.lines() if d.get("event") == "kill"], 60, "no kill")
        run.wait_for(
            lambda: sum(p.poll() == -signal.SIGKILL for p in run.procs) > 0, 10, "no death"
        )
        run.start_rank()
        joiner = len(run.procs) - 1
        run.wait_for(
            lambda: [d for d in run.lines() if d.get("event") == "kill" and d.get("sending")],
            60,
            "no kill while sending",
        )
        codes = run.finish(90)
    finally:
        run.close()
    assert codes.count(-signal.SIGKILL) == 2 and codes.count(0) == 3, (codes, run.output())
    check_training(run, steps)
    mine = [d for d in run.lines(joiner) if "idx" in d]
    # It trained from the epoch after the second death on, with the rest.
    assert mine and mine[0]["world"] == 3 and mine[-1]["step"] == steps - 1, run.output()


@pytest.mark.timeout(150)
def test_a_stall_a_coordinator_restart_and_a_death_through_the_new_coordinator(
    tmp_path: Path, report: Callable[[str], None]
) -> None:
    # One run, three events: rank 2 stalls (SIGSTOP) and is removed, wakes
    # and joins again with live state; the coordinator is killed, and the
    # group waits for it at its next commit (only a coordinator decides one
    # for everyone); a new coordinator rebuilds the group from heartbeats,
    # training resumes, and a rank that dies then is dropped through it.
    steps = 140
    kill_file = tmp_path / "kill-now"
    run = Run(
        tmp_path,
        4,
        STEPS=str(steps),
        STOP_STEP="3",
        STOP_RANK="2",
        SLOW="0.04",
        PACE="0.04",
        KILL_FILE=str(kill_file),
        KILL_RANK="1",
        END_FILE=str(tmp_path / "end-step"),
    )
    try:
        stopping = run.wait_for(
            lambda: [d for d in run.lines() if d.get("event") == "stopping"], 60, "no stall"
        )[0]
        stalled = run.procs[stopping["proc"]]
        run.wait_for(lambda: stalled.poll() is None and _stopped(stalled.pid), 10, "not stopped")
        t_stop = time.time()
        smaller = run.wait_for(
            lambda: [d for d in run.lines() if d.get("world") == 3],
            HEARTBEAT_S + 10,
            "the group never went on without the stalled rank",
        )
        removed_after = min(d["t"] for d in smaller) - t_stop
        os.kill(stalled.pid, signal.SIGCONT)
        run.wait_for(
            lambda: [d for d in run.lines(stopping["proc"]) if d.get("step", 0) > 3],
            30,
            "the stalled rank never trained again",
        )
        # The coordinator goes away; the group waits for it.
        assert run.coordinator is not None
        run.coordinator.kill()
        run.coordinator.wait()
        time.sleep(1.0)
        during = len([d for d in run.lines() if "idx" in d])
        run.start_coordinator()
        run.wait_for(
            lambda: "adopting epoch" in (tmp_path / "coordinator1.log").read_text(),
            30,
            "the restarted coordinator never adopted the epoch",
        )
        run.wait_for(
            lambda: len([d for d in run.lines() if "idx" in d]) > during + 8,
            30,
            "training never resumed with the restarted coordinator",
        )
        kill_file.touch()
        killed = run.wait_for(
            lambda: [d for d in run.lines() if d.get("event") == "kill"], 30, "no death"
        )[0]
        run.wait_for(
            lambda: [d for d in run.lines() if d.get("world") == 3 and d["t"] > killed["t"]],
            HEARTBEAT_S + 10,
            "the group never went on without the dead rank",
        )
        steps = run.end_soon()
        codes = run.finish(90)
    finally:
        run.close()
    assert sorted(codes, key=str) == sorted([0, 0, 0, -signal.SIGKILL], key=str), (
        codes,
        run.output(),
    )
    report(
        f"elastic, SIGSTOP: the survivors' first step without the stalled rank "
        f"{removed_after:.2f}s after it stopped (heartbeat timeout {HEARTBEAT_S:g}s)"
    )
    assert removed_after <= HEARTBEAT_S + 1.0 + 0.5, removed_after
    by_step = check_training(run, steps)
    back = [d for d in run.lines(stopping["proc"]) if "idx" in d]
    assert back and back[-1]["step"] == steps - 1  # it came back and finished
    assert by_step[steps - 1][0]["world"] == 3  # the death after the restart


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.timeout(90)
def test_below_min_world_size_every_survivor_raises_quorum_lost_naming_the_lost(
    tmp_path: Path, report: Callable[[str], None]
) -> None:
    run = Run(tmp_path, 3, STEPS="200", KILL_STEP="3", KILL_RANK="1", MIN_WORLD="3")
    try:
        killed = run.wait_for(
            lambda: [d for d in run.lines() if d.get("event") == "kill"], 60, "no kill"
        )[0]
        codes = run.finish(30)
    finally:
        run.close()
    assert sorted(codes, key=str) == sorted([3, 3, -signal.SIGKILL], key=str), run.output()
    lost = [d for d in run.lines() if d.get("event") == "quorum"]
    assert len(lost) == 2, run.output()
    for d in lost:
        assert d["lost"] == [1] and "[1]" in d["error"], d
    after = max(d["t"] for d in lost) - killed["t"]
    report(f"elastic, quorum lost (min_world_size 3 of 3): raised {after:.2f}s after the death")
    assert after <= 10.0


@pytest.mark.timeout(120)
def test_a_member_stalled_at_start_up_is_removed_and_joins_again_without_a_livelock(
    tmp_path: Path,
) -> None:
    # Rank 2 stalls once it is in the first epoch, before its first step:
    # the others wait for it in the start-up broadcast of rank 0's
    # parameters, remove it, and train with 3. Woken, it fails in that
    # broadcast, joins again with live state at the next boundary, and
    # trains with them: it must not redo the start-up broadcast, which the
    # members are past (that mismatch, failed and recovered at once, kept
    # the group in recovery epochs every 70 ms in a compose run).
    steps = 60
    run = Run(tmp_path, 4, STEPS=str(steps), STOP_AT="start", STOP_RANK="2", SLOW="0.05")
    try:
        stopping = run.wait_for(
            lambda: [d for d in run.lines() if d.get("event") == "stopping"], 60, "no stall"
        )[0]
        stalled = run.procs[stopping["proc"]]
        run.wait_for(lambda: stalled.poll() is None and _stopped(stalled.pid), 10, "not stopped")
        run.wait_for(
            lambda: [d for d in run.lines() if d.get("world") == 3],
            HEARTBEAT_S + 10,
            "the group never went on without the stalled rank",
        )
        os.kill(stalled.pid, signal.SIGCONT)
        run.wait_for(
            lambda: [d for d in run.lines(stopping["proc"]) if "idx" in d],
            30,
            "the stalled rank never trained",
        )
        codes = run.finish(60)
    finally:
        run.close()
    assert codes == [0, 0, 0, 0], (codes, run.output())
    check_training(run, steps)
    mine = [d for d in run.lines(stopping["proc"]) if "idx" in d]
    assert mine[-1]["step"] == steps - 1 and mine[0]["world"] == 4, run.output()
    # Epoch 1, epoch 2 without it, epoch 3 with it again: no recovery loop.
    epochs = {d["epoch"] for d in run.lines() if "epoch" in d}
    assert max(epochs) <= 4, (sorted(epochs), run.output())


@pytest.mark.timeout(120)
def test_a_joiner_with_another_min_world_size_gets_a_config_error_and_the_group_goes_on(
    tmp_path: Path,
) -> None:
    # Issue 55 item 8: a joiner started with min_world_size 5 (the members
    # run with 2) made every member raise QuorumLostError: the coordinator
    # kept the largest value it ever saw. Now the joiner is refused,
    # naming the setting, and the members train on. (120 steps: a joiner
    # slow to start on a loaded host once arrived after 40 had ended.)
    steps = 120
    end = str(tmp_path / "end-step")
    run = Run(tmp_path, 2, STEPS=str(steps), SLOW="0.1", PACE="0.1", END_FILE=end)
    try:
        run.wait_for(lambda: [d for d in run.lines() if d.get("step", 0) >= 3], 60, "no steps")
        run.env = {**run.env, "MIN_WORLD": "5"}
        joiner = run.start_rank()
        joiner.wait(timeout=60)
        steps = run.end_soon()  # (the members train on a few steps, then end)
        codes = run.finish(60)
    finally:
        run.close()
    assert codes[:2] == [0, 0] and codes[2] != 0, (codes, run.output())
    assert "ConfigError" in joiner.stdout and "min_world_size 5" in joiner.stdout, joiner.stdout
    assert "runs with 2" in joiner.stdout, joiner.stdout
    by_step = check_training(run, steps)
    assert all(len(lines) == 2 for lines in by_step.values())


# ------------------------------------------- issue 56: settling, stripes


class _Epoch:
    """The epoch's Backend as ElasticBackend._settle uses it: one all-reduce,
    here among threads (one per member), reduced in rank order."""

    def __init__(self, rank: int, inputs: list[torch.Tensor | None], met: Any) -> None:
        self.rank, self.inputs, self.met = rank, inputs, met
        self.ops: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
            "max": torch.maximum,
            "min": torch.minimum,
            "sum": torch.add,
        }

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.inputs[self.rank] = tensor.clone()
        self.met.wait(5)
        total = self.inputs[0]
        for other in self.inputs[1:]:
            assert total is not None and other is not None
            total = self.ops[op](total, other)
        self.met.wait(5)
        assert total is not None
        return tensor.copy_(total)


def _settled(positions: list[tuple[int, int]]) -> list[tuple[int, bool]]:
    """Members of a new epoch standing at ``positions`` (step, phase) settle:
    each one's agreed position, and whether it is behind the group."""
    import threading

    from ferrogrpc.elastic.backend import ElasticBackend
    from ferrogrpc.elastic.epoch import Membership

    world = len(positions)
    inputs: list[torch.Tensor | None] = [None] * world
    met = threading.Barrier(world)
    members = []
    for rank, (step, phase) in enumerate(positions):
        backend = ElasticBackend.__new__(ElasticBackend)
        backend._current = _Epoch(rank, inputs, met)  # type: ignore[assignment]
        backend._stateless = False
        backend._membership = Membership(2, world, ())
        backend._joined_from = world  # nobody new: no state to hand out
        backend._step, backend._phase, backend._stamped = step, phase, False
        backend.resharders = []  # no sharded model
        members.append(backend)

    def settle(rank: int) -> tuple[int, bool]:
        target = members[rank]._settle()
        return target, members[rank]._behind()

    return on_ranks(settle, world)


def test_members_at_different_positions_settle_on_the_furthest() -> None:
    # Issue 56 item 4: a position is 2 x step, + 1 inside the step's
    # gradient sync. One member at step 6's sync (phase 1: its sync was
    # committed elsewhere, and it never wrote it) and one at step 7's
    # boundary (phase 0) agree on step 7's boundary; the first is behind
    # (it must receive the state), the second goes on with its boundary.
    s = 6
    assert _settled([(s, 1), (s + 1, 0)]) == [(2 * s + 2, True), (2 * s + 2, False)]
    assert _settled([(s + 1, 0), (s, 1)]) == [(2 * s + 2, False), (2 * s + 2, True)]
    # One at step 7's boundary, one in step 7's sync (it passed the
    # boundary the other failed in): the group is inside step 7's sync;
    # nobody is behind (the sync is redone in the new epoch), and the one
    # at the boundary skips ahead into the step.
    assert _settled([(s + 1, 0), (s + 1, 1), (s + 1, 0)]) == [(2 * s + 3, False)] * 3
    # The same place everywhere: nobody behind, nothing to skip.
    assert _settled([(s, 0), (s, 0)]) == [(2 * s, False)] * 2
    assert _settled([(0, 1), (0, 1)]) == [(1, False)] * 2


@pytest.mark.parametrize("members", [1, 2, 3, 4, 5, 7, 64])
def test_the_stripes_cover_every_byte_for_every_size(members: int) -> None:
    # Issue 56 item 5: sizes that are not multiples of 64 (or of the member
    # count): 129 bytes over 2 members, 1 byte over 3, and every size up to
    # a few blocks. The stripes are contiguous, 64-byte aligned but at the
    # end, and cover [0, total) once; their messages cover every byte of
    # every tensor once.
    totals = [*range(0, 300), 64 * members - 1, 64 * members + 1, 1000003]
    for total in totals:
        stripes = _stripes(total, members)
        assert len(stripes) == members, total
        last = 0
        for lo, hi in stripes:
            assert lo == last and lo <= hi <= total, (total, stripes)
            assert lo % 64 == 0 or lo == total, (total, stripes)
            last = hi
        assert last == total, (total, members, stripes)
    for sizes in ([129], [1], [65, 0, 63, 1], [3, 200, 17, 64, 5]):
        total = sum(sizes)
        seen = [bytearray(s) for s in sizes]
        for lo, hi in _stripes(total, members):
            for message in _messages(sizes, lo, hi):
                for seg in message:
                    for i in range(seg.lo, seg.hi):
                        seen[seg.tensor][i] += 1
        assert all(all(c == 1 for c in s) for s in seen), (sizes, members)


@pytest.mark.timeout(120)
def test_a_kill_inside_the_boundary_all_reduce_settles_on_the_furthest_position(
    tmp_path: Path,
) -> None:
    # Issue 56 item 4, with real processes: rank 1 dies inside the flag
    # all-reduce of the boundary before step 4, after its flag reached one
    # member only (a deterministic hook, see elastic_train.py). That member
    # passes the boundary and stands in step 4's sync (position 9); the
    # two others stay at step 4's boundary (position 8). The new epoch
    # agrees on 9: those two skip into step 4, the first redoes only its
    # sync, and no step is lost or doubled.
    steps, kill_step = 10, 3
    run = Run(
        tmp_path,
        4,
        STEPS=str(steps),
        BOUNDARY_KILL_STEP=str(kill_step),
        BOUNDARY_KILL_RANK="1",
        FERROGRPC_SHM="0",  # the flag over gRPC links, where the hook is
        FERROGRPC_DIRECT="0",
        SLOW="0.05",
    )
    try:
        run.wait_for(
            lambda: [d for d in run.lines() if d.get("event") == "kill" and d.get("boundary")],
            60,
            "no kill inside the boundary",
        )
        codes = run.finish(60)
    finally:
        run.close()
    assert sorted(codes, key=str) == sorted([0, 0, 0, -signal.SIGKILL], key=str), run.output()
    passed = [d for d in run.lines() if d.get("event") == "passed"]
    assert len(passed) == 1 and passed[0]["step"] == kill_step + 1, run.output()
    by_step = check_training(run, steps)
    after = by_step[kill_step + 1]
    assert len(after) == 3 and all(d["world"] == 3 for d in after), after
    # The member that passed computed step 4 in the old epoch (its slice of
    # four) and synced it in the new one; the others computed it anew.
    ahead = [d for d in after if d["proc"] == passed[0]["proc"]]
    assert ahead and ahead[0]["idx"] == list(range(passed[0]["rank"], 12, 4)), after
    assert all(len(d["idx"]) == 4 for d in after if d is not ahead[0]), after
    # One new epoch, no recovery loop (a start-up under load may have
    # formed more before the kill: counted from the killed step on).
    before = {d["epoch"] for d in by_step[kill_step]}
    later = {d["epoch"] for step, lines in by_step.items() if step > kill_step for d in lines}
    assert len(before) == 1 and later == {min(before) + 1}, (before, later, run.output())
