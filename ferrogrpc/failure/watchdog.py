"""The lane watchdog: what a lane waits for, and how long is too long.

A lane's sender and receiver wrap every wait on a neighbour in
:meth:`Watchdog.waiting`, which records what each side waits for and when
anything last completed. The watchdog task itself costs nothing per chunk:

- after ``PROBE_S`` without progress it checks that the neighbours waited for
  can still be reached at all: one whose server refuses connections twice
  in a row (its process is gone) is named at once, as a PeerError; one
  whose host gives no answer at all (a slow or lossy link, or a vanished
  host: a killed container) is named only once that silence has lasted
  :func:`silence_bound` of the idle timeout (see [Note: liveness probe] in
  transport/grpc_streams.py);
- after a whole idle timeout without progress it pings them; one whose event
  loop does not answer within another idle timeout is stuck, and named in a
  CollectiveTimeoutError. One that answers is only waiting itself (upstream
  in the ring, or busy with rank-local work before the collective) and is
  waited for, up to the collective's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from ..errors import CollectiveTimeoutError, Evidence, FerroGrpcError, Identity, PeerError
from ..transport.streams import Transport

T = TypeVar("T")

# After this long without progress a lane checks that the neighbours it waits
# for can still be reached.
PROBE_S = 2.0
# A neighbour refused once is probed again this soon, not a whole tick later:
# the second refusal is what names it.
RECHECK_S = 0.25
# Silence from a neighbour's host is a death once it has lasted this share of
# the idle timeout, and never less than SILENCE_MIN_S: a link with a round
# trip of seconds, or SYNs lost several times over, is still a link.
SILENCE_SHARE = 0.25
SILENCE_MIN_S = 4.0


def silence_bound(idle: float) -> float:
    """How long a neighbour's host may give no answer at all before the
    watchdog calls it gone: a quarter of the idle timeout, at least
    SILENCE_MIN_S, at most the idle timeout itself."""
    return min(idle, max(SILENCE_MIN_S, idle * SILENCE_SHARE))


class Watchdog:
    """Watches one lane of the collective ``op#seq``."""

    def __init__(
        self, identity: Identity, transport: Transport, idle: float, op: str, seq: int
    ) -> None:
        self.identity = identity
        self.transport = transport
        self.idle = idle
        self.op = op
        self.seq = seq
        # What each side ("send", "recv") waits for, as (neighbour, what).
        self.waiting: dict[str, tuple[int, str]] = {}
        self.progress_at = time.monotonic()
        # The first of the guarded tasks to fail (see guard()).
        self.first_failure: Exception | None = None

    async def guard(self, *works: Coroutine[Any, Any, None]) -> None:
        """Run ``works`` and this watchdog in one TaskGroup. The first of them
        to fail is noted in ``first_failure`` before the group cancels the
        others: a task cancelled because of it then reports that cause (the
        failure policy's rule 4), not its own cancellation."""
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._noting(work)) for work in works]
            tg.create_task(self._noting(self.run(tasks)))

    async def guard_here(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in this task, watched as :meth:`guard` watches. The
        watchdog task starts only once ``work`` has run for a tick without
        finishing: a small collective usually finishes long before, and then
        costs no task. If the watchdog finds a neighbour gone or stuck, it
        cancels this task and its error is raised here."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Task[None] | None = None
        found: list[FerroGrpcError] = []

        async def watch(never: asyncio.Future[None]) -> None:
            try:
                await self.run([never])
            except FerroGrpcError as exc:
                found.append(exc)
                task.cancel()

        def start() -> None:
            nonlocal watcher
            watcher = loop.create_task(watch(loop.create_future()))

        timer = loop.call_later(min(PROBE_S, self.idle) / 4, start)
        try:
            await self._noting(work)
        except asyncio.CancelledError:
            if not found:
                raise
            task.uncancel()
            if self.first_failure is None:
                self.first_failure = found[0]
            raise found[0] from None
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()

    async def _noting(self, work: Awaitable[None]) -> None:
        try:
            await work
        except Exception as exc:
            if self.first_failure is None:
                self.first_failure = exc
            raise

    async def wait(self, side: str, neighbour: int, what: str, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` while the watchdog knows what ``side`` waits
        for; record progress when it completes. An error without a rank is
        stamped with this rank's identity, naming ``neighbour``."""
        self.waiting[side] = (neighbour, what)
        try:
            result = await awaitable
        except FerroGrpcError as exc:
            raise self.identity.stamp(exc, self.op, self.seq, neighbour) from exc
        finally:
            self.waiting.pop(side, None)
        self.progress_at = time.monotonic()
        return result

    @contextlib.contextmanager
    def awaiting(self, waits: dict[str, tuple[int, str]]) -> Iterator[None]:
        """Within the block, count every ``side: (neighbour, what)`` in
        ``waits`` as waited for, though this task waits for them one at a
        time (each through :meth:`wait` on the same side, which ends its
        entry). The probes then cover every neighbour still to be heard
        from: a rank gone later in the order is named while an earlier one
        is only late, instead of after the idle timeout."""
        self.waiting.update(waits)
        try:
            yield
        finally:
            for side in waits:
                self.waiting.pop(side, None)

    def _error(
        self,
        cls: type[FerroGrpcError],
        message: str,
        peer: int,
        evidence: Evidence = Evidence.FOUND,
    ) -> FerroGrpcError:
        return self.identity.error(
            cls, message, op=self.op, seq=self.seq, peer=peer, evidence=evidence
        )

    async def run(self, work: Sequence[asyncio.Future[None]]) -> None:
        """Watch until every task in ``work`` is done; raise to name a
        neighbour that is gone or stuck."""
        idle = self.idle
        probe = min(PROBE_S, idle)
        refused: set[int] = set()
        silent: dict[int, float] = {}  # neighbour -> when its silence began
        while True:
            # Ticks of a quarter of the probe delay: the first probe comes
            # at most probe * 1.25 after the last progress.
            tick = RECHECK_S if refused else probe / 4
            done, _ = await asyncio.wait(work, timeout=tick)
            if len(done) == len(work):
                return
            stalled = time.monotonic() - self.progress_at
            if stalled < probe:
                refused.clear()  # progress since: refusals must be consecutive
                silent.clear()
                continue
            if stalled < idle:
                await self.probe(probe, refused, silent)
                continue
            for neighbour, what in list(self.waiting.values()):
                try:
                    await self.transport.ping(neighbour, timeout=idle)
                except FerroGrpcError as exc:
                    raise self._error(
                        CollectiveTimeoutError,
                        f"waited {idle:g}s for {what} rank {neighbour} "
                        f"({self.identity.address_of(neighbour)}), which does not answer: it is "
                        f"stuck ({exc.message})",
                        neighbour,
                    ) from None
            self.progress_at = time.monotonic()

    async def probe(self, timeout: float, refused: set[int], silent: dict[int, float]) -> None:
        """Raise PeerError for a waited-for neighbour whose server refused
        two probes in a row, or whose host has given no answer for
        :func:`silence_bound`; an answer, or no answer yet, is left to the
        idle-timeout check."""
        bound = silence_bound(self.idle)
        for neighbour, what in list(self.waiting.values()):
            try:
                await self.transport.ping(neighbour, timeout=timeout)
            except FerroGrpcError as exc:
                if exc.evidence is Evidence.SILENT:
                    refused.discard(neighbour)
                    since = silent.setdefault(neighbour, time.monotonic() - timeout)
                    if time.monotonic() - since >= bound:
                        raise self._error(
                            PeerError,
                            f"waiting for {what} rank {neighbour} "
                            f"({self.identity.address_of(neighbour)}), which is gone: its host "
                            f"has not answered for {time.monotonic() - since:.1f}s "
                            f"({exc.message})",
                            neighbour,
                            Evidence.UNREACHABLE,
                        ) from None
                    continue
                silent.pop(neighbour, None)
                if exc.evidence is not Evidence.UNREACHABLE:
                    refused.discard(neighbour)  # reachable, if slow: not gone
                    continue
                if neighbour in refused:
                    raise self._error(
                        PeerError,
                        f"waiting for {what} rank {neighbour} "
                        f"({self.identity.address_of(neighbour)}), which is gone: it cannot "
                        f"be reached ({exc.message})",
                        neighbour,
                        Evidence.UNREACHABLE,
                    ) from None
                refused.add(neighbour)
            else:
                refused.discard(neighbour)
                silent.pop(neighbour, None)
