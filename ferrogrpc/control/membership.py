"""Elastic membership: the coordinator's record of who is in the group,
epoch by epoch (see [Note: elastic epochs]).

[Note: elastic epochs] An elastic group is a sequence of epochs. Each epoch
is an ordinary ferrogrpc group with fixed members, ranks dense from 0, formed
through the coordinator, which is the only authority on membership (no rank
is a single point of failure, and a rank's view may be stale). The next
epoch forms when:

- members lost ranks (a collective failed naming one, or the coordinator
  found a member silent past the heartbeat timeout): ``RECOVER``. The
  survivors keep their order; the lost ones are dropped.
- joiners wait, and the members reach a step boundary: ``GROW``. The
  joiners take the next ranks. (Only a GROW admits joiners: a RECOVER may
  come in the middle of a step, when there is no state to hand out.)

A gradient sync is committed through the coordinator too (Commit): a
member whose sync finished in epoch E waits until every member of E has
finished it, or until E is being replaced because members were lost. Each
sync's outcome is then the same on every survivor: a lost member may have
sent its last contribution to some survivors and not to others, and only
an authority can tell them apart.

A round for epoch E+1 fixes, when it opens, who is expected in it (E's
members less the dropped, then the waiting joiners); it forms once each has
entered with its new address, or was dropped meanwhile (reported lost, or
silent). Fewer than ``min_world_size`` expected: the round fails, and
everyone in it learns the quorum is lost. A member removed from a forming
epoch (silent, then back) enters as a joiner. A restarted coordinator
rebuilds the current epoch from its members' heartbeats, which carry their
epoch, rank and address.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from ..v1 import rendezvous_pb2 as rpb

logger = logging.getLogger("ferrogrpc.coordinator")

# Trailing metadata of an Enter refused because the group lost its quorum:
# the ranks lost, comma-separated.
LOST_KEY = "ferrogrpc-lost"


@dataclasses.dataclass
class Entry:
    """A process as an epoch lists it."""

    peer_id: str
    address: str
    nonce: str
    host: str = ""


class QuorumLostInRound(Exception):  # noqa: N818 - a verdict, not a fault
    """The next epoch would have fewer than ``min_world_size`` members."""

    def __init__(self, lost: Sequence[int], remaining: int, minimum: int) -> None:
        super().__init__(
            f"quorum lost: ranks {sorted(lost)} of the group are lost, {remaining} remain, "
            f"min_world_size is {minimum}"
        )
        self.lost = sorted(lost)
        self.remaining = remaining
        self.minimum = minimum


@dataclasses.dataclass
class _Round:
    """The forming of epoch ``epoch``."""

    epoch: int
    reason: int
    # Rank order of the new epoch: kept members in their old order, then joiners.
    order: list[str]
    joined_from: int
    # Ranks of the previous epoch dropped from this one.
    dropped: list[int]
    entered: dict[str, Entry] = dataclasses.field(default_factory=dict)
    done: asyncio.Future[rpb.EnterResponse | None] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class ElasticMembership:
    """The membership of one elastic group (see [Note: elastic epochs]).
    Runs on the coordinator's event loop; ``clock`` is injectable for tests."""

    def __init__(
        self,
        *,
        heartbeat_timeout: float,
        join_window: float,
        min_world_size: int = 1,
        initial_world_size: int = 0,
        max_ranks: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.join_window = join_window
        self.min_world_size = min_world_size
        self.initial_world_size = initial_world_size
        self.max_ranks = max_ranks
        self.clock = clock
        self.epoch = 0
        # The latest epoch this coordinator formed or adopted: a heartbeat
        # of a later one means it restarted, and the group is to be adopted
        # (one of an earlier one comes from a process left behind).
        self.highest = 0
        self.run_id = uuid.uuid4().hex[:12]
        # The current epoch: peer ids in rank order, and their entries.
        self.members: list[str | None] = []
        self.entries: dict[str, Entry] = {}
        # Last contact (an Enter or a heartbeat), by peer id.
        self.seen: dict[str, float] = {}
        # Processes waiting to be admitted at the members' next boundary.
        self.joiners: dict[str, Entry] = {}
        # Those of them that entered as joiners while members (removed, or
        # their receipt of the state failed): they lack the state, and are
        # never kept (see _not_kept). A member that enters to recover while
        # a restarted coordinator has not placed it yet waits among the
        # joiners too, and is kept.
        self._stateless: set[str] = set()
        self.round: _Round | None = None
        # When this coordinator adopted an epoch it did not form (restarted).
        self._adopted_at: float | None = None
        # The first epoch, forming: who entered, and the join window's timer.
        self._first: _Round | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Answers of the last rounds, by peer id, for a retried Enter.
        self._answers: dict[str, rpb.EnterResponse] = {}
        # Waiters for the next round that admits joiners.
        self._admission: asyncio.Event = asyncio.Event()
        # The current epoch's syncs: who finished the n-th, and who waits.
        self._finished: dict[int, set[str]] = {}
        self._verdicts: dict[int, asyncio.Future[bool]] = {}
        # Every member of the last epoch left (training ended).
        self.over = False
        # The epoch whose successor failed below quorum, its members, why.
        self._quorum_lost: tuple[int, set[str], QuorumLostInRound] | None = None
        # The latest (epoch, sync) granted without knowing every member.
        self._optimistic: tuple[int, int] = (0, -1)
        # Members of the current epoch that closed their backend.
        self._left: set[str] = set()
        # For the group's metrics (group_metrics.py): epochs formed, members
        # that joined an epoch, and members an epoch dropped.
        self.formed = 0
        self.joined_total = 0
        self.removed_total = 0

    # ------------------------------------------------------------- queries

    def _rank_of(self, peer_id: str) -> int | None:
        try:
            return self.members.index(peer_id)
        except ValueError:
            return None

    def is_member(self, peer_id: str) -> bool:
        return peer_id in self.members or (self.round is not None and peer_id in self.round.order)

    def heartbeat(self, request: rpb.HeartbeatRequest) -> rpb.HeartbeatResponse:
        """A member's or a joiner's heartbeat: it is alive. A restarted
        coordinator learns the current epoch from its members here."""
        peer = request.peer_id
        if request.leaving:
            return self._leave(peer)
        self.seen[peer] = self.clock()
        if request.min_world_size:
            self.min_world_size = max(self.min_world_size, request.min_world_size)
        if request.epoch > self.highest and self._first is None:
            self._adopt(request)
        elif request.epoch == self.epoch and request.epoch and peer not in self.members:
            self._fill(request)
        removed: list[int] = []
        if self.round is not None and request.epoch + 1 == self.round.epoch:
            removed = list(self.round.dropped)
        return rpb.HeartbeatResponse(
            epoch=self.epoch,
            recover_pending=self.round is not None and self.round.reason == rpb.ENTER_RECOVER,
            joiners_waiting=len(self.joiners),
            member=self.is_member(peer),
            removed=removed,
            joiner_addresses=[entry.address for entry in self.joiners.values()],
        )

    def _leave(self, peer: str) -> rpb.HeartbeatResponse:
        """A process closed its backend. Once every member of the current
        epoch has, the group is over (training ended): a new first epoch
        may form. One that leaves alone is lost like any other (the others'
        collectives name it, or it goes silent)."""
        self.joiners.pop(peer, None)
        self._stateless.discard(peer)
        self._left.add(peer)
        over = all(p is None or p in self._left for p in self.members)
        if self.members and self.round is None and self._first is None and over:
            logger.info("every member of epoch %d left: the group is over", self.epoch)
            self.over = True
            self.epoch, self.members, self.entries = 0, [], {}
            self._left.clear()
            self._abort_syncs()
        return rpb.HeartbeatResponse(epoch=self.epoch, member=False)

    def _adopt(self, request: rpb.HeartbeatRequest) -> None:
        """A member of an epoch this coordinator never formed (it restarted):
        take that epoch as the current one, and fill it as members report."""
        logger.info("adopting epoch %d from its members' heartbeats", request.epoch)
        self.epoch = self.highest = int(request.epoch)
        self.members = [None] * max(1, request.world_size)
        self.entries = {}
        self.round = None
        self._adopted_at = self.clock()
        self._fill(request)

    def _fill(self, request: rpb.HeartbeatRequest) -> None:
        rank = self._heartbeat_rank(request)
        if rank is None or not 0 <= rank < len(self.members) or self.members[rank] is not None:
            return
        self.members[rank] = request.peer_id
        self.entries[request.peer_id] = Entry(
            request.peer_id, request.address, request.nonce, request.host
        )

    @staticmethod
    def _heartbeat_rank(request: rpb.HeartbeatRequest) -> int | None:
        return int(request.rank) if request.address else None

    # -------------------------------------------------------------- enter

    async def enter(self, request: rpb.EnterRequest) -> rpb.EnterResponse:
        """Enter the next epoch (see [Note: elastic epochs]); long-polls until
        it formed. Raises QuorumLostInRound."""
        peer = request.peer_id
        self.seen[peer] = self.clock()
        entry = Entry(peer, request.address, request.nonce, request.host)
        if request.min_world_size:
            self.min_world_size = max(self.min_world_size, request.min_world_size)
        answered = self._answers.get(peer)
        if answered is not None and answered.epoch > request.epoch:
            return answered  # a retry: that epoch is formed
        if self._quorum_lost is not None:
            failed, members, err = self._quorum_lost
            if request.epoch == failed and peer in members:
                raise err
        if self.epoch == 0 and self._first is None and not self.members:
            self._first = _Round(1, rpb.ENTER_JOIN, [], 0, [])
        if self._first is not None:
            return await self._enter_first(entry)
        rank = self._rank_of(peer)
        member = request.epoch == self.epoch and rank is not None
        if not member or request.reason == rpb.ENTER_JOIN:
            return await self._enter_as_joiner(entry, stateless=request.reason == rpb.ENTER_JOIN)
        assert rank is not None
        lost = [r for r in request.lost if 0 <= r < len(self.members)]
        if self.round is None:
            await self._settle_adoption(lost)
        current = self.round
        if current is None:
            current = self._open_round(int(request.reason), lost)
        elif lost:
            self._drop(current, lost)
        if current.done.done():
            await current.done  # below quorum: raises QuorumLostInRound
        if peer not in current.order:
            return await self._enter_as_joiner(entry)  # dropped meanwhile
        current.entered[peer] = entry
        self._maybe_form(current)
        result = await asyncio.shield(current.done)
        assert result is not None
        return self._answer(result, peer)

    async def _settle_adoption(self, lost: Sequence[int]) -> None:
        """A restarted coordinator learns an adopted epoch's members from
        their heartbeats: before the next epoch opens, wait until every
        member not reported lost has been heard from (a slot still unknown
        after the heartbeat timeout is a member that is gone). A poll:
        the timeout is noticed by time passing, not by an event."""
        while (  # noqa: ASYNC110
            self._adopted_at is not None
            and self.round is None
            and self.clock() - self._adopted_at <= self.heartbeat_timeout
            and any(p is None and r not in lost for r, p in enumerate(self.members))
        ):
            await asyncio.sleep(0.05)

    async def _enter_first(self, entry: Entry) -> rpb.EnterResponse:
        first = self._first
        assert first is not None
        if entry.peer_id not in first.entered:
            if len(first.entered) >= self.max_ranks:
                raise QuorumLostInRound([], len(first.entered), self.min_world_size)
            first.order.append(entry.peer_id)
        first.entered[entry.peer_id] = entry
        logger.info("%d processes entered the first epoch", len(first.entered))
        if self.initial_world_size:
            if len(first.entered) >= self.initial_world_size:
                self._form_first()
        else:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if len(first.entered) >= self.min_world_size:
                self._timer = asyncio.get_running_loop().call_later(
                    self.join_window, self._form_first
                )
        result = await asyncio.shield(first.done)
        assert result is not None
        return self._answer(result, entry.peer_id)

    def _form_first(self) -> None:
        first = self._first
        if first is None or first.done.done():
            return
        self._timer = None
        self._first = None
        first.joined_from = len(first.order)  # the first epoch: nobody joins late
        self._form(first)

    async def _enter_as_joiner(self, entry: Entry, stateless: bool = False) -> rpb.EnterResponse:
        self.joiners[entry.peer_id] = entry
        if stateless:
            self._stateless.add(entry.peer_id)
        logger.info("a joiner waits (%d waiting)", len(self.joiners))
        while True:
            if self.epoch == 0:  # the group ended (quorum lost): start anew
                self.joiners.pop(entry.peer_id, None)
                if self._first is None:
                    self._first = _Round(1, rpb.ENTER_JOIN, [], 0, [])
                return await self._enter_first(entry)
            current = self.round
            if (
                current is not None
                and entry.peer_id in current.order
                and entry.peer_id in self._stateless
            ):
                self._not_kept(current, entry.peer_id)
            if current is not None and entry.peer_id in current.order:
                current.entered[entry.peer_id] = entry
                self._maybe_form(current)
                result = await asyncio.shield(current.done)
                assert result is not None
                return self._answer(result, entry.peer_id)
            event = self._admission
            await event.wait()

    def _open_round(self, reason: int, lost: Sequence[int]) -> _Round:
        """Open the round of epoch E+1: E's members less ``lost``, the
        silent and those that entered as joiners (lacking the state), then
        every waiting joiner (at a GROW). Fails it at once below quorum."""
        now = self.clock()
        dropped = sorted(
            {
                rank
                for rank, peer in enumerate(self.members)
                if rank in lost
                or peer is None
                or peer in self._stateless
                or now - self.seen.get(peer, now) > self.heartbeat_timeout
            }
        )
        kept = [p for r, p in enumerate(self.members) if r not in dropped and p is not None]
        joiners = [
            p
            for p in self.joiners
            if reason == rpb.ENTER_GROW and now - self.seen.get(p, now) <= self.heartbeat_timeout
        ]
        current = _Round(self.epoch + 1, reason, kept + joiners, len(kept), dropped)
        self.round = current
        logger.info(
            "epoch %d forming (%s): %d kept, %d joining, ranks %s dropped",
            current.epoch,
            rpb.EnterReason.Name(reason),
            len(kept),
            len(joiners),
            dropped,
        )
        self._admission.set()
        self._admission = asyncio.Event()
        if reason == rpb.ENTER_RECOVER:
            self._abort_syncs()
        self._check_quorum(current)
        return current

    def _not_kept(self, current: _Round, peer: str) -> None:
        """A member of E that enters ``current`` as a joiner lacks the
        group's state (it was removed, or its receipt failed): it is never
        kept. At a GROW it moves to the joiners, and receives the state; a
        RECOVER (which may come mid-step, with no state to hand out) goes on
        without it, and it waits for the next GROW."""
        index = current.order.index(peer)
        if index >= current.joined_from:
            return
        current.order.remove(peer)
        current.joined_from -= 1
        if current.reason == rpb.ENTER_GROW:
            current.order.append(peer)
            return
        rank = self._rank_of(peer)
        if rank is not None and rank not in current.dropped:
            current.dropped.append(rank)
            current.dropped.sort()
        self._check_quorum(current)
        self._maybe_form(current)

    def _drop(self, current: _Round, ranks: Sequence[int]) -> None:
        """Ranks of the previous epoch found lost while ``current`` forms."""
        for rank in ranks:
            if rank in current.dropped or rank >= len(self.members):
                continue
            peer = self.members[rank]
            if peer is None or peer not in current.order or peer in current.entered:
                continue  # entered already: alive
            current.order.remove(peer)
            current.joined_from -= 1
            current.dropped.append(rank)
            current.dropped.sort()
        self._check_quorum(current)
        self._maybe_form(current)

    def _check_quorum(self, current: _Round) -> None:
        if len(current.order) >= self.min_world_size or current.done.done():
            return
        err = QuorumLostInRound(current.dropped, len(current.order), self.min_world_size)
        logger.warning("%s", err)
        # The members of the failed epoch learn it when they enter next.
        self._quorum_lost = (current.epoch - 1, set(p for p in self.members if p), err)
        current.done.set_exception(err)
        current.done.exception()
        if self.round is current:
            self.round = None
        # The group is over: a new first epoch may form from whoever enters.
        self.epoch, self.members, self.entries = 0, [], {}
        self.joiners.clear()
        self._stateless.clear()
        self._admission.set()
        self._admission = asyncio.Event()

    def _maybe_form(self, current: _Round) -> None:
        if current.done.done() or any(p not in current.entered for p in current.order):
            return
        self._form(current)

    def _form(self, current: _Round) -> None:
        self._abort_syncs()
        order = current.order
        self._left.clear()
        self.over = False
        self.epoch = current.epoch
        self.highest = max(self.highest, current.epoch)
        self.members = list(order)
        self.entries = {p: current.entered[p] for p in order}
        self.formed += 1
        self.joined_total += len(order) - current.joined_from
        self.removed_total += len(current.dropped)
        for peer in order:
            self.joiners.pop(peer, None)
            self._stateless.discard(peer)
            self.seen[peer] = self.clock()
        if self.round is current:
            self.round = None
        entries = [self.entries[p] for p in order]
        result = rpb.EnterResponse(
            epoch=self.epoch,
            world_size=len(order),
            addresses=[e.address for e in entries],
            nonces=[e.nonce for e in entries],
            hosts=[e.host for e in entries],
            joined_from=current.joined_from,
            run_id=self.run_id,
        )
        logger.info("epoch %d formed: %d members", self.epoch, len(order))
        current.done.set_result(result)
        for peer in order:
            self._answers[peer] = self._answer(result, peer)
        # Answers of processes no longer in the group go.
        for peer in [p for p in self._answers if p not in self.entries]:
            del self._answers[peer]

    def _answer(self, result: rpb.EnterResponse, peer: str) -> rpb.EnterResponse:
        answer = rpb.EnterResponse()
        answer.CopyFrom(result)
        answer.rank = self.members.index(peer) if peer in self.members else 0
        return answer

    # -------------------------------------------------------------- commits

    async def commit(self, request: rpb.CommitRequest) -> bool:
        """The n-th gradient sync of ``request.epoch`` finished on this
        member: True once it has on every member, False if that epoch is
        (being) replaced because members were lost."""
        peer, n = request.peer_id, int(request.n)
        self.seen[peer] = self.clock()
        epoch = int(request.epoch)
        restarted = epoch > self.highest  # no heartbeat of that epoch yet
        adopting = (
            epoch == self.epoch
            and self._adopted_at is not None
            and any(p is None for p in self.members)
        )
        if restarted or adopting or (epoch, n) <= self._optimistic:
            # This coordinator restarted during that epoch and does not know
            # every member yet: granted, as a member's client grants it
            # while no coordinator answers; the n-th sync is then granted to
            # every member, whenever it asks.
            self._optimistic = max(self._optimistic, (epoch, n))
            return True
        if request.epoch != self.epoch or peer not in self.members:
            return False
        if self.round is not None and self.round.reason == rpb.ENTER_RECOVER:
            return False
        finished = self._finished.setdefault(n, set())
        finished.add(peer)
        verdict = self._verdicts.get(n)
        if verdict is None:
            verdict = self._verdicts[n] = asyncio.get_running_loop().create_future()
        if all(p is not None and p in finished for p in self.members):
            if not verdict.done():
                verdict.set_result(True)
            # Older syncs are settled: forget them.
            for old in [k for k in self._finished if k < n]:
                del self._finished[old]
                self._verdicts.pop(old, None)
        return await asyncio.shield(verdict)

    def _abort_syncs(self) -> None:
        for verdict in self._verdicts.values():
            if not verdict.done():
                verdict.set_result(False)
        self._verdicts.clear()
        self._finished.clear()

    # -------------------------------------------------------------- silence

    def check_silence(self) -> None:
        """Drop members and joiners silent past the heartbeat timeout: a
        member of the current epoch opens a RECOVER round (or is dropped
        from the forming one)."""
        now = self.clock()
        timeout = self.heartbeat_timeout
        if self.members and all(p is None or p in self._left for p in self.members):
            return  # (every member left: _leave ends the group)
        for peer in [p for p in self.joiners if now - self.seen.get(p, now) > timeout]:
            del self.joiners[peer]
            self._stateless.discard(peer)
            current = self.round
            if (
                current is not None
                and peer in current.order[current.joined_from :]
                and peer not in current.entered
            ):
                current.order.remove(peer)
                self._maybe_form(current)
        if self.epoch == 0 or self._first is not None:
            return
        adopted = self._adopted_at
        silent = [
            rank
            for rank, peer in enumerate(self.members)
            if (peer is None and adopted is not None and now - adopted > timeout)
            or (peer is not None and now - self.seen.get(peer, now) > timeout)
        ]
        if not silent:
            return
        if self.round is None:
            logger.warning("ranks %s of epoch %d went silent", silent, self.epoch)
            self._open_round(rpb.ENTER_RECOVER, silent)
        else:
            self._drop(self.round, silent)
