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
  come in the middle of a step, when there is no state to hand out.) With
  ``max_world_size``, a GROW admits joiners up to it; the others wait as
  spares, ready, and the first boundary after a member is lost admits one.

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
epoch (silent, then back) enters as a joiner.

[Note: a restarted coordinator]
A restarted coordinator knows nothing, and must not forget what the
members still know. It rebuilds the current epoch from its members'
heartbeats, which carry their epoch, rank, address, min_world_size and
how many of the epoch's syncs they had committed:

- It forms no first epoch until a heartbeat timeout has passed since it
  started (``quiet``): a running group's members beat every quarter of
  that, so a group that exists is heard from first. A heartbeat of a
  running group adopts it even while a first epoch is forming; whoever
  entered that first epoch then waits as a joiner.
- An Enter or a Commit of an epoch it has not adopted waits for the
  heartbeats that adopt it (and is answered UNAVAILABLE, to be retried,
  if none comes): it is never taken for a fresh group's.
- Once it holds a group, a heartbeat of an epoch it did not form is
  refused: after an adoption only this coordinator forms epochs.
- Commits are decided only here, one decision for everyone: a member
  that cannot reach a coordinator waits for one (membership_client.py).
  A sync that a member reports committed (by the coordinator before the
  restart) is granted to every member that asks, even while a RECOVER
  replaces the epoch, or after; any other is committed once every member
  finished it, and refused if the epoch is replaced.
- The heartbeat timeout holds for adopted members from the adoption on: a
  slot nobody reported by then is a member that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from ..v1 import rendezvous_pb2 as rpb
from . import rounds
from .commits import SyncLedger
from .rounds import Entry, GroupOver, NotAdopted, QuorumLostInRound, _Round

logger = logging.getLogger("ferrogrpc.coordinator")

# Trailing metadata of an Enter refused because the group lost its quorum:
# the ranks lost, comma-separated.
LOST_KEY = "ferrogrpc-lost"

# How often an Enter or a Commit that waits for an adoption looks again.
POLL_S = 0.05


class ElasticMembership:
    """The membership of one elastic group (see [Note: elastic epochs]).
    Runs on the coordinator's event loop; ``clock`` is injectable for tests."""

    def __init__(
        self,
        *,
        heartbeat_timeout: float,
        join_window: float,
        min_world_size: int = 1,
        max_world_size: int = 0,
        initial_world_size: int = 0,
        max_ranks: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        quiet: float | None = None,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.join_window = join_window
        # The coordinator's own floor (--min-ranks), and the one the
        # group's members run with (their min_world_size, which every
        # joiner must match): the quorum is the larger.
        self.floor = min_world_size
        self.members_min = 0
        # The most members an epoch takes (0: any; beyond it joiners wait as
        # spares): the coordinator's own (--max-world-size) or its members'.
        self.cap = max_world_size
        self.members_max = 0
        self.initial_world_size = initial_world_size
        self.max_ranks = max_ranks
        self.clock = clock
        # No first epoch forms before this long after the start (see
        # [Note: a restarted coordinator]).
        self.quiet = heartbeat_timeout if quiet is None else quiet
        self._started = clock()
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
        # When it adopted an epoch it did not form, and if it formed one since.
        self._adopted_at: float | None = None
        self._formed_since_adoption = False
        # The first epoch, forming: who entered, and the join window's timer.
        self._first: _Round | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Answers of the last rounds, by peer id, for a retried Enter.
        self._answers: dict[str, rpb.EnterResponse] = {}
        # Waiters for the next round that admits joiners.
        self._admission: asyncio.Event = asyncio.Event()
        # The current epoch's syncs (commits.py).
        self.syncs = SyncLedger()
        # Every member of the last epoch left (training ended).
        self.over = False
        # The epoch whose successor failed below quorum, its members, why.
        self._quorum_lost: tuple[int, set[str], QuorumLostInRound] | None = None
        # Heartbeats of epochs this coordinator did not form, refused.
        self.refused = 0
        # Members of the current epoch that closed their backend.
        self._left: set[str] = set()
        # Called as a RECOVER round opens (the coordinator's Watches.hurry).
        self.on_recover: Callable[[], None] = lambda: None
        # Metrics (group_metrics.py): epochs formed, members joined, dropped.
        self.formed = 0
        self.joined_total = 0
        self.removed_total = 0

    @property
    def min_world_size(self) -> int:
        return max(self.floor, self.members_min)

    @property
    def max_world_size(self) -> int:
        return min([n for n in (self.cap, self.members_max) if n], default=0)

    def waiting(self, kept: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
        """The joiners a GROW keeping ``kept`` (default: the members, less
        those that entered as joiners) would admit now, and the spares beyond
        them (see [Note: elastic epochs])."""
        now = self.clock()
        if kept is None:
            kept = [p for p in self.members if p is not None and p not in self._stateless]
        fresh = [
            p
            for p in self.joiners
            if p not in kept and now - self.seen.get(p, now) <= self.heartbeat_timeout
        ]
        admit = rounds.admitted(fresh, len(kept), self.max_world_size)
        return admit, [p for p in self.joiners if p not in admit and p not in kept]

    @property
    def ended(self) -> str:
        """Why the last group ended, while no new one has formed ("": none did)."""
        if self.epoch or self.round is not None:
            return ""
        if self.over:
            return "every member of the last epoch left"
        return str(self._quorum_lost[2]) if self._quorum_lost is not None else ""

    # ------------------------------------------------------------- queries

    def _rank_of(self, peer_id: str) -> int | None:
        return self.members.index(peer_id) if peer_id in self.members else None

    def is_member(self, peer_id: str) -> bool:
        return peer_id in self.members or (self.round is not None and peer_id in self.round.order)

    def heartbeat(self, request: rpb.HeartbeatRequest) -> rpb.HeartbeatResponse:
        """A member's or a joiner's heartbeat: it is alive. A restarted
        coordinator learns the current epoch from its members here."""
        peer = request.peer_id
        if request.leaving:
            return self._leave(peer)
        self.seen[peer] = self.clock()
        if request.epoch > self.highest:
            if self._may_adopt(request):
                self._adopt(request)
            else:
                self.refused += 1
                if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, 8, ...: rate-limited
                    logger.warning(
                        "refused a heartbeat of epoch %d, which this coordinator did not form "
                        "(its epoch is %d; %d refused so far)",
                        request.epoch,
                        self.epoch,
                        self.refused,
                    )
        elif request.epoch == self.epoch and request.epoch and peer not in self.members:
            self._fill(request)
        if request.epoch == self.epoch and request.epoch and peer in self.members:
            if request.min_world_size:
                self.members_min = max(self.members_min, int(request.min_world_size))
            self.members_max = self.members_max or int(request.max_world_size)
            self.syncs.note_committed(peer, int(request.committed), self.epoch)
        r = self.round
        removed = list(r.dropped) if r is not None and request.epoch + 1 == r.epoch else []
        admit, spares = self.waiting()
        return rpb.HeartbeatResponse(
            epoch=self.epoch,
            recover_pending=self.round is not None and self.round.reason == rpb.ENTER_RECOVER,
            joiners_waiting=len(admit),
            member=self.is_member(peer),
            removed=removed,
            # (Spares too: members connect to them ahead, as to joiners.)
            joiner_addresses=[entry.address for entry in self.joiners.values()],
            spare=peer in spares,
            world_size=len(self.members),
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
            self.syncs.close()
            self._admission.set()  # the spares waiting learn it (GroupOver)
            self._admission = asyncio.Event()
        return rpb.HeartbeatResponse(epoch=self.epoch, member=False)

    def _may_adopt(self, request: rpb.HeartbeatRequest) -> bool:
        """Whether a heartbeat of an epoch later than any this coordinator
        formed or adopted is a running group's to adopt: only while this
        coordinator holds no group (it restarted, or the last group ended),
        or is still hearing from the one it adopts (a later epoch than a
        straggler's); never one it formed itself (see [Note: a restarted
        coordinator]). The heartbeat must describe a place in a group."""
        size = request.world_size
        if not request.address or not (0 < size <= self.max_ranks and request.rank < size):
            return False
        if self.round is None and (self.epoch == 0 or not any(self.members)):
            return True
        adopted = self._adopted_at
        return (
            adopted is not None
            and self.round is None
            and self.highest == self.epoch
            and self.clock() - adopted <= self.heartbeat_timeout
            and not self._formed_since_adoption
        )

    def _adopt(self, request: rpb.HeartbeatRequest) -> None:
        """A member of an epoch this coordinator never formed (it restarted):
        take that epoch as the current one, and fill it as members report.
        A first epoch forming meanwhile is abandoned: whoever entered it
        waits as a joiner of the adopted group."""
        logger.info("adopting epoch %d from its members' heartbeats", request.epoch)
        first = self._first
        if first is not None:
            self._first = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for peer, entry in first.entered.items():
                self.joiners[peer] = entry
                self._stateless.add(peer)
            if not first.done.done():
                first.done.set_result(None)
        self.syncs.close()
        self.epoch = self.highest = int(request.epoch)
        self.members = [None] * request.world_size
        self.entries = {}
        self.round = None
        self._adopted_at = self.clock()
        self._formed_since_adoption = False
        self.over = False
        self._left.clear()
        self._fill(request)

    def _fill(self, request: rpb.HeartbeatRequest) -> None:
        rank = int(request.rank) if request.address else None
        if rank is None or not 0 <= rank < len(self.members) or self.members[rank] is not None:
            return
        if request.peer_id in self.members:
            return  # already placed (a rank it reports differently is not believed)
        self.members[rank] = request.peer_id
        self.entries[request.peer_id] = Entry(
            request.peer_id, request.address, request.nonce, request.host
        )

    # -------------------------------------------------------------- enter

    async def enter(self, request: rpb.EnterRequest) -> rpb.EnterResponse:
        """Enter the next epoch (see [Note: elastic epochs]); long-polls until
        it formed. Raises QuorumLostInRound, SettingMismatch (a joiner's
        min_world_size is not the group's) or NotAdopted (an epoch this
        coordinator does not know, after waiting for its heartbeats)."""
        peer = request.peer_id
        self.seen[peer] = self.clock()
        entry = Entry.entering(request)
        answered = self._answers.get(peer)
        if answered is not None and answered.epoch > request.epoch:
            return answered  # a retry: that epoch is formed
        if self._quorum_lost is not None:
            failed, members, err = self._quorum_lost
            if request.epoch == failed and peer in members:
                raise err
        if request.epoch > self.highest:
            # A member of an epoch this coordinator never formed: it
            # restarted, and waits for the heartbeats that adopt the group.
            await self._await_epoch(int(request.epoch))
        rank = self._rank_of(peer)
        if request.epoch and request.epoch == self.epoch and rank is None:
            await self._settle_adoption(())  # its heartbeat may place it yet
            rank = self._rank_of(peer)
        member = request.epoch == self.epoch and rank is not None
        if not member and (self.epoch or self.round):
            rounds.check_setting(entry, self.members_min, self.members_max)
        if self.epoch == 0 and self._first is None and not self.members and request.epoch == 0:
            self._first = _Round(1, rpb.ENTER_JOIN, [], 0, [])
        if self._first is not None and request.epoch == 0:
            return await self._enter_first(entry)
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
        return await self._enter_round(current, entry)

    async def _enter_round(self, current: _Round, entry: Entry) -> rpb.EnterResponse:
        """Wait in ``current`` until it formed. One dropped from it after it
        entered (silent past the heartbeat timeout) lacks the new epoch's
        state and waits for the next GROW, as a joiner."""
        current.entered[entry.peer_id] = entry
        self._maybe_form(current)
        result = await asyncio.shield(current.done)
        assert result is not None
        if entry.peer_id not in current.order:
            return await self._enter_as_joiner(entry, stateless=True)
        return self._answer(result, entry.peer_id)

    async def _await_epoch(self, epoch: int) -> None:
        """Until ``epoch`` is adopted (its members' heartbeats), for up to the
        heartbeat timeout and a quarter (a member beats every quarter):
        NotAdopted if it never is. A poll, like _settle_adoption."""
        deadline = self.clock() + 1.25 * self.heartbeat_timeout
        while self.highest < epoch and self.clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
        if self.highest < epoch:
            raise NotAdopted(
                f"epoch {epoch} is unknown to this coordinator (its epoch is {self.epoch}): "
                "it restarted, and no member of that epoch has reported to it yet"
            )

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
                self._schedule_first(0.0)
        else:
            need = max([self.floor, *(e.min_world_size for e in first.entered.values())])
            if len(first.entered) >= need:
                self._schedule_first(self.join_window)
            elif self._timer is not None:
                self._timer.cancel()
                self._timer = None
        result = await asyncio.shield(first.done)
        if result is None:
            # A running group was heard from meanwhile (this coordinator
            # restarted): it admits this process at its next boundary.
            return await self._enter_as_joiner(entry, stateless=True)
        if entry.peer_id not in first.order:  # beyond max_world_size: a spare
            return await self._enter_as_joiner(entry)
        return self._answer(result, entry.peer_id)

    def _schedule_first(self, delay: float) -> None:
        """Form the first epoch in ``delay`` seconds, and not within the quiet
        period after this coordinator started (see [Note: a restarted
        coordinator])."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        delay = max(delay, self._started + self.quiet - self.clock())
        if delay <= 0:
            self._form_first()
        else:
            self._timer = asyncio.get_running_loop().call_later(delay, self._form_first)

    def _form_first(self) -> None:
        first = self._first
        if first is None or first.done.done():
            return
        self._timer = None
        if self.clock() < self._started + self.quiet:
            self._schedule_first(0.0)
            return
        self._first = None
        self.members_min = max(e.min_world_size for e in first.entered.values())
        self.members_max = min(
            [e.max_world_size for e in first.entered.values() if e.max_world_size], default=0
        )
        size = len(rounds.admitted(first.order, 0, self.max_world_size))
        for peer in first.order[min(size, self.initial_world_size or size) :]:
            # Beyond --world-size, a joiner of the first boundary; beyond
            # max_world_size, a spare.
            self.joiners[peer] = first.entered.pop(peer)
        first.order = [p for p in first.order if p in first.entered]
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
                if self.over:  # every member left: training is done
                    raise GroupOver(f"the elastic group ended ({self.ended})")
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
                return await self._enter_round(current, entry)
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
        # (A member that entered before a restarted coordinator placed it
        # waits among the joiners too: it is listed once, kept.)
        joiners = self.waiting(kept)[0] if reason == rpb.ENTER_GROW else []
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
            self.syncs.close()
            self.on_recover()
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

    def _drop(self, current: _Round, ranks: Sequence[int], silent: bool = False) -> None:
        """Ranks of the previous epoch found lost while ``current`` forms: a
        member's report skips one that entered it since (alive, then), but
        silence drops it all the same (it entered, and died or stalled)."""
        for rank in ranks:
            if rank in current.dropped or rank >= len(self.members):
                continue
            peer = self.members[rank]
            if peer is None or peer not in current.order:
                continue
            if peer in current.entered:
                if not silent:
                    continue  # entered already: alive
                del current.entered[peer]
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
        self.syncs.close()
        order = current.order
        self._left.clear()
        self.over = False
        self.epoch = current.epoch
        self.highest = max(self.highest, current.epoch)
        self._formed_since_adoption = True
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
        # (Answers of processes no longer in the group go.)
        self._answers = {peer: self._answer(result, peer) for peer in order}

    def _answer(self, result: rpb.EnterResponse, peer: str) -> rpb.EnterResponse:
        return rounds.placed(result, self._rank_of(peer) or 0)

    # -------------------------------------------------------------- commits

    async def commit(self, request: rpb.CommitRequest) -> bool:
        """Sync n of ``request.epoch`` finished on this member: True once on
        every member, or a member's heartbeat says it was committed (a verdict
        that stands once the epoch is replaced); else False if the epoch is
        (being) replaced. Never on a guess ([Note: a restarted coordinator]).
        NotAdopted: an epoch this coordinator does not know."""
        peer, n = request.peer_id, int(request.n)
        epoch = int(request.epoch)
        if epoch > self.highest:
            await self._await_epoch(epoch)
        if epoch == self.epoch and peer not in self.members:
            await self._settle_adoption(())  # its heartbeat may place it yet
        if epoch != self.epoch:  # replaced: what was decided stands
            return self.syncs.decided(epoch, n)
        if peer not in self.members:
            return False
        self.seen[peer] = self.clock()
        if self.round is not None and self.round.reason == rpb.ENTER_RECOVER:
            return self.syncs.decided(epoch, n)
        return await self.syncs.finished(peer, n, self.members)

    # -------------------------------------------------------------- silence

    def vanished(self, peer: str) -> None:
        """A process's Watch call ended (liveness.py): unless it left, it is silent now."""
        if peer in self.seen and peer not in self._left:
            self.seen[peer] = self.clock() - self.heartbeat_timeout - 1.0
            self.check_silence()

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
            if current is not None and peer in current.order[current.joined_from :]:
                # (Entered or not: a silent one would hold the epoch up.)
                current.entered.pop(peer, None)
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
        if silent and self.round is None:
            logger.warning("ranks %s of epoch %d went silent", silent, self.epoch)
            self._open_round(rpb.ENTER_RECOVER, silent)
        elif silent and self.round is not None:
            self._drop(self.round, silent, silent=True)
