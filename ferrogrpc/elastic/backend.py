"""The elastic backend: a blocking Backend whose group changes while it
trains, one epoch at a time (see [Note: elastic epochs] in
control/membership.py).

Each epoch is an ordinary ferrogrpc group: a Peer on this backend's event
loop, formed through the coordinator. A collective that fails because a
member is lost breaks that epoch only: :meth:`ElasticBackend.recover` closes
it and enters the next one with the survivors, renumbered densely in their
old order. Joiners are admitted at step boundaries (:meth:`boundary`, which
``ElasticState.steps`` calls), where every member agrees, in one tiny
all-reduce, whether any wait. A heartbeat thread keeps the coordinator
informed; when it learns that the group moves on without finishing this
epoch (a member went silent, or this process itself was removed), it breaks
this epoch's peer, so that whatever waits in it fails at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..algorithms.descriptor import make_stamp
from ..control.membership_client import Beat, EpochRendezvous, MembershipClient
from ..env import Settings
from ..errors import (
    CollectiveTimeoutError,
    ConfigError,
    Evidence,
    FerroGrpcError,
    PeerError,
    QuorumLostError,
    RendezvousError,
    ShardLostError,
)
from ..observe import metrics
from ..runtime.backend import COLLECTIVES, Backend, prepare
from ..runtime.join import Ahead, close_channels
from ..runtime.peer import Peer, observer_of
from ..samehost.plane import segment_bytes
from ..samehost.segment import Spare
from ..transport.grpc_streams import GrpcTransport
from ..v1 import rendezvous_pb2 as rpb
from .epoch import GroupState, Membership, Resharder, Settling, StartFailed, removal, start_peer
from .progress import Progress

logger = logging.getLogger("ferrogrpc.elastic")

# What no new epoch mends: raised, never recovered from.
FATAL = (QuorumLostError, ConfigError, ShardLostError)


class ElasticBackend:
    """A Backend whose membership may change (``init_backend(elastic=True)``).

    ``rank``, ``world_size`` and ``membership`` are the current epoch's. Its
    collectives are a Backend's, run in the current epoch: one that fails
    because a member is lost raises as it would on a Backend; DDP's
    ``sync_gradients()`` and ``ElasticState.steps()`` recover from it (a
    loop of your own may call :meth:`recover`). A process that joins a
    running group is admitted at the members' next step boundary, in its
    first ``steps()``: until then its ``rank`` is -1.

    Synchronizes: every collective, as on a Backend, within the epoch;
    :meth:`recover` and :meth:`boundary` through the coordinator.

    Raises:
        QuorumLostError: fewer than ``min_world_size`` members remain.
        RendezvousError: the coordinator could not be reached within the
            connect timeout when the group had to change.
    """

    elastic = True

    def __init__(self, settings: Settings, client: MembershipClient) -> None:
        self._s = settings
        self._client = client
        assert settings.coordinator is not None
        target_host = settings.coordinator.rsplit(":", 1)[0]
        self._bind, self._advertise, self._loop, self._thread = prepare(settings, target_host)
        self._current: Backend | None = None
        self._epoch = 0
        self._joined_from = 0
        # Admitted in join() to a running group's epoch (the first formed as
        # it entered): a joiner until its first boundary receives the state.
        self._stateless = False
        self._membership = Membership(0, 0, ())
        # Set from the heartbeat thread: the group moved on without this
        # epoch (the ranks it removed), or without this process.
        self._removed_ranks: list[int] = []
        self._removed_me = False
        self._lock = threading.Lock()
        self._closed = False
        # The next epoch's shared segment, made ahead ([Note: a segment made
        # ahead]), and channels to the joiners that wait (_connect_ahead).
        self._spare = Spare()
        self._ahead = Ahead(self._spare)
        # The state a joiner receives, and members send (ElasticState).
        self.state: GroupState | None = None
        # Sharded models whose shards move at every new epoch (FSDP's).
        self.resharders: list[Resharder] = []
        # Where this process is (see _settle): the step it runs, 0 at its
        # boundary or 1 in its gradient sync; the gradient syncs of this
        # epoch so far (each committed through the coordinator); the
        # position the last new epoch agreed on; changes since a step.
        self._step, self._phase, self._syncs, self._last_target = 0, 0, 0, 0
        self._progress, self._void_step = Progress(), -1  # (a void step: run_sync)
        # Whether this epoch's collectives carry the step (see _stamp).
        self._stamped = False
        self._starting: tuple[EpochRendezvous, concurrent.futures.Future[Peer]] | None = None
        client.on_heartbeat = self._on_heartbeat
        # The metrics port serves on between epochs (observe/metrics.py).
        self._release_metrics = metrics.hold(settings)

    # ------------------------------------------------------------ identity

    @property
    def rank(self) -> int:
        """This process's rank in the current epoch, renumbered densely
        when the group changes. A joiner's is -1 until ``steps()`` admits it
        (and a member removed for a stall is -1 until it is admitted again)."""
        return -1 if self.joining else self._own_rank

    @property
    def _own_rank(self) -> int:
        return self._current.rank if self._current is not None else -1

    @property
    def world_size(self) -> int:
        """The current epoch's number of members (0 before the first)."""
        return self._membership.world_size

    @property
    def membership(self) -> Membership:
        """The current epoch: its number, world size and members."""
        return self._membership

    @property
    def address(self) -> str:
        """The ``host:port`` of this process's peer in the current epoch
        (empty while it waits to be admitted)."""
        return self._current.address if self._current is not None else ""

    @property
    def data_path(self) -> str:
        """The current epoch's data path (see :attr:`Backend.data_path`);
        ``"none"`` while this process waits to be admitted."""
        return self._current.data_path if self._current is not None else "none"

    @property
    def peer(self) -> Peer:
        """The current epoch's asyncio peer."""
        return self._require().peer

    @property
    def step_index(self) -> int:
        """The step this process is at (set at each step boundary)."""
        return self._step

    @property
    def joined_from(self) -> int:
        """Ranks at and above this one joined in the current epoch."""
        return self._joined_from

    def _require(self) -> Backend:
        if self._current is None:
            raise ConfigError(
                "this process is not a member of the group yet: it is admitted at the "
                "group's next step boundary, in its first ElasticState.steps()"
            )
        return self._current

    # --------------------------------------------------------- collectives

    def __getattr__(self, name: str) -> Any:
        # The collectives (all_reduce, broadcast, ...) are the current
        # epoch's Backend's.
        if name in COLLECTIVES:
            return getattr(self._require(), name)
        raise AttributeError(f"'ElasticBackend' object has no attribute {name!r}")

    # -------------------------------------------------------------- epochs

    def _enter(self, reason: int, lost: Sequence[int] = ()) -> rpb.EnterResponse:
        """Close this epoch's peer, if any, and start the next epoch's
        through the coordinator. Blocks until that epoch formed and this
        process's peer in it started.

        An epoch that formed, but in which this process could not start its
        peer (a rank on this host died meanwhile, and its socket refused),
        is left at once for the next: entered to recover (naming that rank)
        by a member, which holds the state, else as a joiner."""
        while True:
            try:
                return self._start_epoch(reason, lost)
            except StartFailed as failed:
                formed, exc = failed.formed, failed.error
                if self._closed:
                    raise exc from None
                was_member = formed.rank < formed.joined_from
                logger.warning(
                    "epoch %d formed, but this process could not start its peer in it (%s): "
                    "entering the next epoch%s",
                    formed.epoch,
                    exc,
                    "" if was_member else " as a joiner",
                )
                self._epoch = int(formed.epoch)
                reason = rpb.ENTER_RECOVER if was_member else rpb.ENTER_JOIN
                lost = [exc.peer] if exc.peer is not None else []

    def _start_epoch(self, reason: int, lost: Sequence[int]) -> rpb.EnterResponse:
        """One try of :meth:`_enter`.

        The old peer closes while the next epoch forms (epoch.py)."""
        old = self._current
        rendezvous = EpochRendezvous(self._client, reason, self._epoch, lost)
        s = self._s
        began = time.monotonic()
        closed_at = [began]
        self._current = None
        starting = asyncio.run_coroutine_threadsafe(
            start_peer(
                old.peer if old is not None else None,
                rendezvous,
                settings=s,
                bind_host=self._bind,
                advertise_host=self._advertise,
                ahead=self._ahead,
                closed_at=closed_at,
            ),
            self._loop,
        )
        self._starting = (rendezvous, starting)
        try:
            # A joiner may wait as a hot spare: its Enter bounds its own wait.
            peer = starting.result(None if reason == rpb.ENTER_JOIN else s.timeouts.connect + 30)
        except BaseException as exc:
            if isinstance(exc, concurrent.futures.CancelledError) and rendezvous.response:
                # (_on_heartbeat: the epoch being started is replaced already.)
                exc = PeerError("a member of this epoch could not start in it", rank=self.rank)
            starting.cancel()
            with contextlib.suppress(BaseException):
                starting.result(timeout=10)
            if isinstance(exc, TimeoutError) and not isinstance(exc, FerroGrpcError):
                raise RendezvousError(
                    f"the next epoch did not form within {s.timeouts.connect + 30:g}s"
                ) from exc
            formed = rendezvous.response
            if (
                formed is not None
                and isinstance(exc, FerroGrpcError)
                and not isinstance(exc, (QuorumLostError, ConfigError))
            ):
                raise StartFailed(formed, exc) from exc
            raise
        finally:
            self._starting = None
        response = rendezvous.response
        assert response is not None
        with self._lock:
            self._current = Backend(peer, self._loop, self._thread)
            self._epoch = int(response.epoch)
            self._joined_from = int(response.joined_from)
            self._removed_ranks = []
            self._removed_me = False
            self._syncs = 0
            self._stamped = False
            self._membership = Membership(
                self._epoch,
                int(response.world_size),
                tuple(response.addresses),
                tuple(response.hosts),
            )
        metrics.note_epoch(observer_of(peer), self._epoch)
        self._client.set_beat(
            Beat(
                epoch=self._epoch,
                rank=peer.rank,
                world_size=peer.world_size,
                address=peer.address,
                nonce=str(response.nonces[peer.rank]),
                host=str(response.hosts[peer.rank]) if response.hosts else "",
            )
        )
        now = time.monotonic()
        logger.info(
            "epoch %d: rank %d of %d (%s), formed in %.3f s (the last epoch's peer closed "
            "in %.3f s)",
            self._epoch,
            peer.rank,
            peer.world_size,
            rpb.EnterReason.Name(reason),
            now - began,
            closed_at[0] - began,
        )
        return response

    def join(self) -> None:
        """Enter the group: a member of the first epoch if it is forming
        (blocks until it formed), else a joiner that waits for the members'
        next boundary (in :meth:`boundary`; one admitted here because the
        first epoch formed as it entered receives the state there)."""
        self._client.start()
        latest = self._client.heartbeat_once(timeout=max(1.0, self._s.timeouts.connect))
        if latest is not None and latest.epoch > 0:  # a running group
            self._prepare_spare()  # (the segment, made while it waits)
            return
        formed = self._enter(rpb.ENTER_JOIN)
        self._stateless = formed.rank >= formed.joined_from

    @property
    def joining(self) -> bool:
        """Whether this process waits to be admitted (not a member yet)."""
        return self._current is None or self._stateless

    def recover(self, cause: FerroGrpcError | None = None) -> bool:
        """After a collective of the current epoch failed (with ``cause``):
        enter the next epoch with the survivors, reporting the rank
        ``cause`` names if it is lost (gone, or silent), and agree with them
        on where the group is. Returns True if this process was no longer a
        member and joined again: it then holds the group's state (received
        through its ElasticState), and the step it was in is discarded. A
        new epoch that fails as it settles is recovered from in turn.

        Raises:
            QuorumLostError: fewer than ``min_world_size`` would remain.
        """
        self._progress.changed(cause, self.rank)
        rejoined = False
        while True:
            try:
                return self._recover_once(cause) or rejoined
            except Settling as failed:
                rejoined = rejoined or failed.rejoined
                cause = failed.error
                if self._closed:
                    raise cause from None
                logger.info("the new epoch failed as it settled (%s): recovering again", cause)

    def _recover_once(self, cause: FerroGrpcError | None) -> bool:
        with self._lock:
            removed_me = self._removed_me
            lost = list(self._removed_ranks)
        if (
            cause is not None
            and cause.peer is not None
            and (
                cause.evidence is Evidence.UNREACHABLE or isinstance(cause, CollectiveTimeoutError)
            )
            and cause.peer not in lost
        ):
            lost.append(cause.peer)
        was = self.rank
        # A process whose receipt of the state failed midway joins again, to
        # receive it whole.
        incomplete = self.state is not None and self.state.incomplete
        reason = rpb.ENTER_JOIN if removed_me or incomplete or self.joining else rpb.ENTER_RECOVER
        try:
            self._enter(reason, lost)
        except QuorumLostError as exc:
            raise self._quorum_lost(exc, lost) from exc
        if self.state is not None:
            # A transfer of the last epoch still running can only fail now
            # (its peer is closed); a joiner of it is incomplete, and joined
            # again above to receive the state anew.
            self.state.abandon_transfer()
        # (The coordinator places a process that enters as a joiner among
        # the joiners, so a rejoined process is one that received the state.)
        rejoined = self._own_rank >= self._joined_from
        if rejoined:
            logger.info("rank %d of the last epoch joined again as rank %d", was, self._own_rank)
        try:
            self._settle()
        except FATAL:
            raise
        except FerroGrpcError as exc:
            raise Settling(exc, rejoined) from exc
        return rejoined

    def _settle(self) -> int:
        """Every member of a new epoch, in the same order: the members hand
        the group's state to those new in it, then all agree on where the
        group is. Returns the furthest position (2 x step, + 1 inside a
        step's gradient sync): a member behind it skips ahead to it."""
        if self._joined_from < self.world_size:
            if self._own_rank >= self._joined_from:
                self._receive_state()
            else:
                assert self.state is not None
                self.state.send_to_joiners(self._joined_from)
        position = torch.tensor([2 * self._step + self._phase], dtype=torch.int64)
        self._stamp(False)  # members at different places meet here, by design
        self._require().all_reduce(position, "max")
        self._last_target = int(position.item())
        # Shards move to the new layout, which takes effect everywhere or
        # nowhere: committed like a sync ([Note: shards held twice]).
        swaps = [r.reshard(self._own_rank >= self._joined_from) for r in self.resharders]
        if swaps and not self._commit():
            raise PeerError("the group changed again while its shards moved", rank=self.rank)
        for swap in swaps:
            swap()
        return self._last_target

    def _stamp(self, on: bool) -> None:
        """Stamp this epoch's collectives with the step (on), or not (the
        boundary's own): members at two steps fail a collective with a
        ProtocolError naming both, never mixing their contributions."""
        current = self._current
        if current is None or self._stamped == on:
            return
        self._stamped = on
        current.peer._set_stamp(make_stamp(self._epoch, self._step) if on else 0)

    def _behind(self) -> bool:
        """Whether the group (as a new epoch agreed) is past this step's sync,
        committed on the others, not here: then this joins again, for the state."""
        return self._last_target > 2 * self._step + 1

    def _rejoin(self) -> None:
        """Leave the epoch (the others' collectives with it fail); join again for the state."""
        logger.warning(
            "rank %d is behind the group (at position %d, the group at %d): it joins again "
            "to receive the group's state",
            self.rank,
            2 * self._step + self._phase,
            self._last_target,
        )
        self._enter(rpb.ENTER_JOIN)
        try:
            self._settle()
        except FATAL:
            raise
        except FerroGrpcError as exc:
            self.recover(exc)

    def _receive_state(self) -> None:
        if self.state is None:
            raise ConfigError(
                "this process joined a running elastic group without an ElasticState to "
                "receive the group's state into: build fg.ElasticState(model, optimizer) "
                "before the first step"
            )
        self._step = self.state.receive_from_members(self._joined_from)
        self.state.step = self._step
        self._phase = 0
        self._stateless = False

    def _quorum_lost(self, exc: QuorumLostError, reported: list[int]) -> QuorumLostError:
        lost = exc.lost or reported
        return QuorumLostError(
            f"the elastic group lost its quorum: {exc.message}",
            lost=lost,
            rank=self.rank if self._current is not None else None,
            world_size=self._membership.world_size,
            peer=lost[0] if lost else None,
        )

    def _prepare_spare(self) -> None:
        """The next epoch's segment, made ahead (Spare.prepare_next)."""
        current = self._current
        if self._s.shm:
            local = current is not None and (current.data_path != "grpc" or current.world_size == 1)
            self._spare.prepare_next(segment_bytes(), current is None, local)

    def boundary(self, step: int) -> bool:
        """A step boundary, before ``step`` (``ElasticState.steps`` calls
        it): a joiner is admitted here and receives the group's state;
        members agree whether joiners wait and, if so, admit them and send
        them the state. Returns True if this process received the state
        here (the group's step index came with it: ``ElasticState.step``)."""
        self._step, self._phase = step, 0
        self._stamp(False)
        try:
            received = self._boundary()
        finally:
            with contextlib.suppress(Exception):
                self._stamp(True)
        return received

    def _boundary(self) -> bool:
        received = False
        # A step after the last change of epoch: the next one's segment.
        self._prepare_spare()
        # A step without a sync may have left the last transfer running: it
        # ends here, on the first pass only. A transfer this boundary begins
        # goes on during the step (see [Note: the state in two parts]).
        finish_last = self.state is not None
        while True:
            try:
                if finish_last and self.state is not None:
                    finish_last = False
                    self.state.finish_transfer()
                if self.joining:
                    if self._current is None:
                        self._enter(rpb.ENTER_JOIN)
                    received = True
                    if self._settle() > 2 * self._step:
                        return received
                    continue
                with self._lock:
                    superseded = self._removed_me or bool(self._removed_ranks)
                broken = self.peer._life.broken
                if superseded or broken is not None:
                    received = self.recover(broken) or received
                    if self._behind():
                        self._rejoin()
                        return True
                    continue
                if self._void_step == self._step < self._last_target / 2:
                    # This step was void here (FSDP's), and the group is past this
                    # boundary: it re-runs without it, as the others ([Note: shards held twice]).
                    return received
                latest = self._client.latest
                # (An answer from before this epoch formed may still count
                # the joiners it admitted.)
                waiting = (
                    1
                    if latest is not None
                    and latest.joiners_waiting
                    and latest.epoch >= self._epoch
                    and latest.epoch > 0
                    else 0
                )
                flag = torch.tensor([waiting], dtype=torch.int32)
                self._require().all_reduce(flag, "max")
                if int(flag.item()) == 0:
                    self._progress.made()
                    return received
                if self.state is not None:
                    # Every member sends its stripe of a state it holds
                    # whole: the transfer of a grow just done lands first.
                    self.state.finish_transfer()
                self._enter(rpb.ENTER_GROW)  # (removed meanwhile: placed as a joiner)
                received = received or self._own_rank >= self._joined_from
                if self._settle() > 2 * self._step:
                    return received
            except FATAL:
                raise
            except FerroGrpcError as exc:
                if self._closed:
                    raise
                logger.info("the epoch failed at a step boundary (%s): recovering", exc)
                received = self.recover(exc) or received
                if self._behind():
                    self._rejoin()
                    return True
                if 2 * self._step < self._last_target:
                    return received

    def run_sync(self, attempt: Callable[[], Callable[[], None]], rerun: bool = False) -> bool:
        """Run a gradient sync. ``attempt()`` runs the collectives and returns
        what writes the result (the ``.grad``), called only once every
        member committed this sync through the coordinator: a lost member may
        have sent its last part to some survivors and not to others. If
        members are lost, DDP's sync is redone in the next epoch with the
        survivors; with ``rerun`` (FSDP's, whose shards move to the next
        epoch: [Note: shards held twice]) the step is void instead, and runs
        again over the new group. Returns True if the step is discarded
        (void, or this process joined again)."""
        self._phase = 1
        while True:
            try:
                if self.state is not None:
                    # The optimizer's part of a transfer lands (a joiner) or
                    # leaves (a member) before the optimizer may touch it.
                    self.state.finish_transfer()
                write = attempt()
                if self._commit():
                    write()
                    self._progress.made()
                    return False
                cause: FerroGrpcError = PeerError(
                    "the group lost members before this sync was committed: it is "
                    + ("run again" if rerun else "redone with the survivors"),
                    rank=self.rank,
                )
            except FATAL:
                raise
            except FerroGrpcError as exc:
                cause = exc
            rejoined = self.recover(cause) or rerun
            if not rejoined and self._behind():
                self._rejoin()
                rejoined = True
            if rejoined:
                self._void_step = self._step if rerun else -1
                if self.state is not None:
                    self.state.rejoined()  # the step's index is the group's
                return True
            self._stamp(True)  # the redo, in the new epoch, at this step

    def _commit(self) -> bool:
        """Commit this epoch's next sync through the coordinator (a member
        lost after its last part was sent is found here). This epoch's peer
        broken: given up, unless the coordinator removed ranks of it, when its
        verdict comes at once and may be True (granted before a restart)."""
        n = self._syncs
        self._syncs += 1
        epoch = self._epoch
        asking = asyncio.run_coroutine_threadsafe(self._client.commit(epoch, n), self._loop)
        life = self._require().peer._life
        while True:
            try:
                granted = asking.result(timeout=0.05)
                if granted:  # heartbeats say so ([Note: a restarted coordinator])
                    self._client.set_committed(epoch, n + 1)
                return granted
            except concurrent.futures.TimeoutError:
                broken = life.broken
                if broken is not None and not (self._removed_me or self._removed_ranks):
                    asking.cancel()
                    raise broken from None

    # ---------------------------------------------------------- heartbeats

    def _on_heartbeat(self, response: rpb.HeartbeatResponse) -> None:
        """On the heartbeat thread: connect to the joiners that wait; break
        this epoch's peer if the group moves on without finishing it
        (members removed), or without this process; stop starting an epoch
        that is replaced already (a member of it could not start)."""
        starting = self._starting
        formed = starting[0].response if starting is not None else None
        if starting and formed and response.recover_pending and response.epoch == formed.epoch:
            starting[1].cancel()
        current = self._current
        if current is None or self._epoch == 0:
            return
        if response.epoch == self._epoch and (response.joiner_addresses or self._ahead.channels):
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self._loop.call_soon_threadsafe(
                    self._connect_ahead, current, tuple(response.joiner_addresses)
                )
        notice = removal(response, self._epoch)
        if notice is None:
            return
        with self._lock:
            if current is not self._current:
                return
            self._removed_me = self._removed_me or notice.me
            self._removed_ranks = sorted(set(self._removed_ranks) | set(notice.ranks))
        peer = current.peer

        def breaking() -> None:
            err = peer._me.error(
                PeerError, notice.message, peer=notice.culprit, evidence=Evidence.UNREACHABLE
            )
            peer._ctx.failure.declare(err, broadcast=False)

        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._loop.call_soon_threadsafe(breaking)

    def _connect_ahead(self, current: Backend, addresses: Sequence[str]) -> None:
        """On the loop: connect to the joiners that wait (see [Note:
        connecting ahead] in transport/grpc_streams.py)."""
        transport = current.peer._ctx.transport
        if current is self._current and isinstance(transport, GrpcTransport):
            self._ahead.connect(transport, addresses)

    # --------------------------------------------------------------- close

    def close(self) -> None:
        """Leave the group and release everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._spare.close()
        self._client.close()
        channels = self._ahead.take_channels()
        if channels:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(
                    close_channels(channels.values()), self._loop
                ).result(timeout=2)
        current = self._current
        if current is not None:
            current.close()  # stops the loop thread too
        else:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._loop.is_running() and not self._loop.is_closed():
                self._loop.close()
        self._release_metrics()

    def __enter__(self) -> ElasticBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        m = self._membership
        return f"<ferrogrpc.ElasticBackend rank {self.rank}/{m.world_size} epoch {m.epoch}>"
