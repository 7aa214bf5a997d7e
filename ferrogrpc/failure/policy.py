"""The failure policy: whom to blame, and how every rank comes to agree.

One module decides what a failed collective raises. It holds the *broken*
state (the first failure, which every later call re-raises), broadcasts a
rank's own finding to the other ranks as an abort, waits a moment for
another rank's report when all this rank saw was a symptom, and picks the
account that names the culprit. What a decision needs travels in the error
itself, set when it was built: its :class:`~ferrogrpc.errors.Evidence`.

The rules, in order:

1. A symptom (a stream that ended, a write that failed) names a neighbour
   that may only have failed because of something else; so does another
   rank's in-band report of a symptom it saw. Wait up to
   ``ECHO_GRACE_S`` for a report, and ping that neighbour meanwhile: one that
   does not answer is the cause, at once; one that answers gets up to twice
   the grace for its report to land.
2. What this rank found itself in the collective's data (a checksum or
   header failure, a mismatch) is its account, even when another rank's
   relay of the same finding arrived first.
3. Otherwise the first failure recorded wins: a report that arrived (out of
   band, or in band on a stream) over this rank's later symptom.
4. A lane task cancelled because its sibling failed reports the sibling's
   failure, never its own cancellation.

A *refusal* is not a break. A rank whose call fails its own argument checks
still takes the collective's sequence number and tells every rank
(:meth:`FailurePolicy.tell_refusal`); each fails that collective with a
ConfigError naming the refusing rank and its message (whatever else it saw
meanwhile: the refusal is the cause), and the group stays usable, since
every rank's sequence moved alike. The one exception: a refusal that
reaches a rank in the middle of a round through shared memory, which cannot
be undone; that breaks the group (:meth:`FailurePolicy.plane_survives`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from ..errors import (
    ERROR_CLASSES,
    CollectiveTimeoutError,
    ConfigError,
    Evidence,
    FerroGrpcError,
    Identity,
    PeerError,
    ProtocolError,
)
from ..lifecycle import Lifecycle
from ..v1 import collective_pb2 as pb

logger = logging.getLogger("ferrogrpc")

# How long a rank that saw only a symptom waits for another rank's report of
# the cause before the symptom stands.
ECHO_GRACE_S = 1.0

# How long an abort notice may take to reach one rank.
ABORT_SEND_S = 2.0

# An abort's message is cut to this many characters (it travels in band, in
# a chunk's header, within the receive limit).
ABORT_MESSAGE_MAX = 8192


class Notifier(Protocol):
    """What the policy needs of a transport: to ask a rank whether it is
    alive, and to tell it about a failure."""

    async def ping(self, dst: int, timeout: float) -> None: ...

    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None: ...


def _no_name(seq: int) -> str | None:
    return None


def _no_refusal(seq: int) -> FerroGrpcError | None:
    return None


def _ignore_refusal(seq: int, err: FerroGrpcError) -> bool:
    return True


class FailurePolicy:
    """The broken state of one rank and every decision about blame.

    The broken state itself is the rank's :class:`Lifecycle` (``life``; a
    fresh one, open, when none is given). ``on_break(err)`` is called once,
    when the rank breaks, to stop the collectives still running (they then
    raise ``err``); ``name_of(seq)``
    names a collective by its sequence number, for reports that only carry
    the number. ``refusal_of(seq)`` says whether collective ``seq`` was
    refused by some rank, and ``on_refusal(seq, err)`` records another
    rank's refusal (and stops the job for it); both are the job table's.
    """

    def __init__(
        self,
        identity: Identity,
        notifier: Notifier,
        *,
        group: int = 0,
        nonce: str = "",
        life: Lifecycle | None = None,
        on_break: Callable[[FerroGrpcError], None] | None = None,
        name_of: Callable[[int], str | None] = _no_name,
        refusal_of: Callable[[int], FerroGrpcError | None] = _no_refusal,
        on_refusal: Callable[[int, FerroGrpcError], bool] = _ignore_refusal,
    ) -> None:
        self.identity = identity
        self._notifier = notifier
        self._group = group
        self._nonce = nonce
        self._on_break = on_break
        self._name_of = name_of
        self._refusal_of = refusal_of
        self._on_refusal = on_refusal
        # Who waits for a refusal of a collective, by seq (see await_report).
        self._refusal_waiters: dict[int, asyncio.Future[None]] = {}
        if life is None:
            life = Lifecycle()
            life.open(identity)
        self._life = life
        self._broken_event = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def broken(self) -> FerroGrpcError | None:
        """The failure that broke this rank, or None."""
        return self._life.cause

    def _fields(self, err: FerroGrpcError, peer: int | None = None) -> dict[str, Any]:
        """A log line's fields (observe/logs.py, [Note: logs]) for ``err``."""
        me = self.identity
        return {
            "rank": me.rank,
            "world_size": me.world_size,
            "op": err.op,
            "seq": err.seq,
            "peer": err.peer if peer is None else peer,
        }

    # ------------------------------------------------------------ reports

    def abort_message(self, err: FerroGrpcError) -> pb.Abort:
        """``err`` as the report this rank sends to others. A refusal travels
        as its bare message (relays do not stack prefixes), marked refused."""
        refused = err.evidence is Evidence.REFUSED
        return pb.Abort(
            group=self._group,
            seq=err.seq or 0,
            from_rank=self.identity.rank,
            error=type(err).__name__,
            message=(err.message if refused else str(err))[:ABORT_MESSAGE_MAX],
            culprit=err.peer if err.peer is not None else -1,
            nonce=self._nonce,
            refused=refused,
            symptom=err.evidence is Evidence.SYMPTOM,
        )

    def from_report(self, abort: pb.Abort) -> FerroGrpcError:
        """Another rank's report, as this rank raises it. A report of a
        symptom stays a symptom (rule 1 applies to it here too): a rank that
        fails tells its neighbour in band before it has waited for the cause."""
        culprit = abort.culprit if 0 <= abort.culprit < self.identity.world_size else None
        if abort.refused:
            return self.identity.error(
                ConfigError,
                abort.message,
                op=self._name_of(abort.seq),
                seq=abort.seq,
                peer=culprit,
                evidence=Evidence.REFUSED,
            )
        cls = ERROR_CLASSES.get(abort.error, PeerError)
        return self.identity.error(
            cls,
            f"rank {abort.from_rank} reported: {abort.message}",
            op=self._name_of(abort.seq),
            seq=abort.seq,
            peer=culprit,
            evidence=Evidence.SYMPTOM if abort.symptom else Evidence.RELAYED,
        )

    def receive(self, abort: pb.Abort) -> None:
        """A report that arrived out of band (already authenticated)."""
        if abort.refused:
            self._note_refusal(abort.seq, self.from_report(abort))
            return
        self.declare(self.from_report(abort), broadcast=False)

    # ------------------------------------------------------------ refusals

    def refusal_error(self, op: str, seq: int, message: str) -> ConfigError:
        """This rank's own refusal of ``op#seq``, as the others will raise it:
        a ConfigError naming this rank and ``message``."""
        me = self.identity.rank
        return self.identity.error(
            ConfigError,
            f"rank {me}'s own argument checks refused its call of {op}: {message}",
            op=op,
            seq=seq,
            peer=me,
            evidence=Evidence.REFUSED,
        )

    def tell_refusal(self, err: FerroGrpcError) -> None:
        """Tell every other rank that this rank refused collective
        ``err.seq`` (see :meth:`refusal_error`). The group is not broken."""
        abort = self.abort_message(err).SerializeToString()
        for dst in range(self.identity.world_size):
            if dst != self.identity.rank:
                self._spawn(self._send_abort(dst, abort))

    def refusal(self, op: str, seq: int) -> FerroGrpcError | None:
        """The refusal of collective ``op#seq``, as this rank raises it; None
        if no rank refused it."""
        err = self._refusal_of(seq)
        if err is None:
            return None
        return self.identity.error(
            type(err), err.message, op=op, seq=seq, peer=err.peer, evidence=Evidence.REFUSED
        )

    def _note_refusal(self, seq: int, err: FerroGrpcError) -> None:
        self._on_refusal(seq, err)
        waiter = self._refusal_waiters.get(seq)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def plane_survives(self, cause: FerroGrpcError, mid_round: bool) -> bool:
        """Whether a collective that failed with ``cause`` leaves this host's
        shared-memory plane usable, so that this rank must not abort it:
        only a refusal that stopped this rank outside a round does. A
        refusal that stopped it mid-round (the host's ranks now disagree on
        which rounds ran) breaks the group."""
        if cause.evidence is not Evidence.REFUSED:
            return False
        if not mid_round:
            return True
        self.declare(
            self.identity.error(
                ConfigError,
                f"{cause.message} (it arrived while this host's ranks were moving the "
                "collective's bytes through shared memory, which cannot be undone, so the group "
                "is broken)",
                op=cause.op,
                seq=cause.seq,
                peer=cause.peer,
            ),
            broadcast=True,
        )
        return False

    # ------------------------------------------------------------ breaking

    def declare(self, err: FerroGrpcError, *, broadcast: bool) -> None:
        """Enter the broken state with ``err``: stop every running
        collective and, with ``broadcast``, tell every other rank. Only the
        first call counts."""
        if not self._life.break_with(err):
            return
        # One structured line per break (INFO: the error itself is raised).
        logger.info("broke: %s", err.message, extra=self._fields(err))
        self._broken_event.set()
        if self._on_break is not None:
            self._on_break(err)
        if broadcast:
            abort = self.abort_message(err).SerializeToString()
            # A culprit that cannot be reached (its process or its host is
            # gone) is not told: the notice could only wait out its timeout,
            # and hold up close() by as much.
            gone = err.peer if err.evidence is Evidence.UNREACHABLE else None
            for dst in range(self.identity.world_size):
                if dst not in (self.identity.rank, gone):
                    self._spawn(self._send_abort(dst, abort))

    def deadline_passed(self, op: str, seq: int, seconds: float) -> FerroGrpcError:
        """The collective ``op#seq`` missed its deadline: break, and return
        the error to raise."""
        err = self.identity.error(
            CollectiveTimeoutError,
            f"did not finish within the {seconds:g}s collective deadline",
            op=op,
            seq=seq,
        )
        self.declare(err, broadcast=True)
        return err

    async def _send_abort(self, dst: int, abort: bytes) -> None:
        try:
            await self._notifier.send_abort(dst, abort, timeout=ABORT_SEND_S)
        except FerroGrpcError as exc:
            logger.debug(
                "abort to rank %d not delivered: %s", dst, exc, extra=self._fields(exc, peer=dst)
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float) -> None:
        """Let abort notices still in flight land (they carry the cause to
        the other ranks), for up to ``timeout``; cancel the rest."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)
        for task in list(self._background):
            task.cancel()

    # ------------------------------------------------------------ deciding

    def cause(
        self, exc: BaseException, op: str, seq: int, sibling: BaseException | None = None
    ) -> FerroGrpcError:
        """Why a lane task stopped, as the error to pass on: ``exc`` itself,
        the first real error in a group, or, for a task cancelled because
        ``sibling`` failed, the sibling's failure (rule 4)."""
        if isinstance(exc, FerroGrpcError):
            return self.identity.stamp(exc, op, seq)
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                if not isinstance(inner, asyncio.CancelledError):
                    return self.cause(inner, op, seq, sibling)
        refusal = self.refusal(op, seq)
        if refusal is not None:
            return refusal  # cancelled because some rank refused the collective
        if sibling is not None and sibling is not exc:
            return self.cause(sibling, op, seq)
        if self._life.cause is not None:
            return self._life.cause
        return self.identity.error(
            PeerError, f"the collective was interrupted ({exc!r})", op=op, seq=seq
        )

    async def settle(self, exc: FerroGrpcError, op: str, seq: int) -> FerroGrpcError:
        """Decide what the failed collective ``op#seq`` raises, given what
        it failed with, and tell the other ranks if this rank found it. A
        refusal of it by some rank (known, or relayed with ``exc``) is the
        cause, and breaks nothing."""
        refusal = self.refusal(op, seq)
        if refusal is None and exc.evidence is Evidence.REFUSED:
            refusal = self.identity.stamp(exc, op, seq)
            self._note_refusal(seq, refusal)
        if refusal is None and exc.evidence is Evidence.SYMPTOM and self._life.cause is None:
            await self.await_report(exc.peer, seq)
            refusal = self.refusal(op, seq)
        if refusal is not None:
            return refusal
        err = self.identity.stamp(exc, op, seq)
        if isinstance(err, ProtocolError) and err.evidence is Evidence.FOUND and err.seq == seq:
            # Rule 2: this rank's own finding in this collective's data.
            # Symptoms such as a refused stream still defer to a report.
            self.declare(err, broadcast=True)
            return err
        broken = self._life.cause
        if broken is None:
            self.declare(err, broadcast=True)
            return err
        if broken.seq == seq or broken.op is None:
            message = broken.message
        else:
            message = f"aborted because {broken.op}#{broken.seq} failed: {broken.message}"
        return self.identity.error(type(broken), message, op=op, seq=seq, peer=broken.peer)

    def tell(self, cause: FerroGrpcError, seq: int, send: Callable[[pb.Abort], None]) -> None:
        """Tell others why this rank failed collective ``seq`` through
        ``send`` (the same-host plane's abort): ``cause``; or, when that is
        only a symptom (rule 1), the report that broke this rank if it is
        here, else the symptom now and the report once it lands, in the
        background (not cancelled with the collective), for the receiver to
        put in the symptom's place."""
        if cause.evidence is Evidence.SYMPTOM:
            broken = self._life.cause
            if broken is not None and broken.evidence is not Evidence.SYMPTOM:
                cause = broken
            else:

                async def later() -> None:
                    await self.await_report(cause.peer, seq)
                    better = self._life.cause
                    if better is not None and better.evidence is not Evidence.SYMPTOM:
                        send(self.abort_message(better))

                self._spawn(later())
        send(self.abort_message(cause))

    async def await_report(self, named: int | None, seq: int | None = None) -> None:
        """Rule 1: wait up to ECHO_GRACE_S for a rank's report (or a refusal
        of collective ``seq``), pinging the neighbour the symptom named;
        return early once a report arrived or that neighbour failed to
        answer."""
        loop = asyncio.get_running_loop()
        broken = asyncio.ensure_future(self._broken_event.wait())
        reports: set[asyncio.Future[Any]] = {broken}
        if seq is not None:
            refused = self._refusal_waiters.setdefault(seq, loop.create_future())
            reports.add(refused)
        waits = set(reports)
        ping: asyncio.Future[None] | None = None
        if named is not None and named != self.identity.rank:
            ping = asyncio.ensure_future(self._notifier.ping(named, timeout=ECHO_GRACE_S))
            waits.add(ping)
        try:
            deadline = loop.time() + ECHO_GRACE_S
            while not any(r.done() for r in reports):
                left = deadline - loop.time()
                if left <= 0:
                    return
                done, _ = await asyncio.wait(
                    waits, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                if ping is not None and ping in done:
                    waits.discard(ping)
                    if ping.exception() is not None:
                        return  # the named neighbour is gone or stuck: it is the cause
                    deadline += ECHO_GRACE_S  # alive: its report is on its way
                    ping = None
                if not done:
                    return
        finally:
            for task in (broken, ping):
                if task is not None and not task.done():
                    task.cancel()
            if seq is not None:
                self._refusal_waiters.pop(seq, None)
