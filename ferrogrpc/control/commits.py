"""The commit ledger of an elastic group's current epoch: which of its
gradient syncs each member finished, and the one verdict every member of
the epoch gets for each (see [Note: elastic epochs] and [Note: a
restarted coordinator] in membership.py). Runs on the coordinator's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence


class SyncLedger:
    """The verdicts of one epoch's syncs: True once every member finished a
    sync (or a member's heartbeat says it was committed already), False for
    every one still open when the epoch is replaced."""

    def __init__(self) -> None:
        # Who finished the n-th sync, and the verdict its askers wait for.
        self._finished: dict[int, set[str]] = {}
        self._verdicts: dict[int, asyncio.Future[bool]] = {}
        # How many syncs each member had committed, as its heartbeats say
        # (a restarted coordinator's evidence of the verdicts before it).
        self._committed: dict[str, int] = {}
        # Per epoch, the most syncs any member said were committed: kept
        # past close(), since a verdict once given stands (:meth:`decided`).
        self._known: dict[int, int] = {}

    async def finished(self, peer: str, n: int, members: Sequence[str | None]) -> bool:
        """``peer`` finished sync ``n``: its verdict, once it is known."""
        self._finished.setdefault(n, set()).add(peer)
        verdict = self._verdicts.get(n)
        if verdict is None:
            verdict = self._verdicts[n] = asyncio.get_running_loop().create_future()
        done = self._finished[n]
        if max(self._committed.values(), default=0) > n or all(
            p is not None and p in done for p in members
        ):
            self._grant(n)
        return await asyncio.shield(verdict)

    def note_committed(self, peer: str, committed: int, epoch: int) -> None:
        """A member's heartbeat: it had ``committed`` syncs of ``epoch`` (the
        current one) committed. Those were decided (here, or by the
        coordinator before a restart): every member asking for them gets
        True."""
        if committed > self._known.get(epoch, 0):
            self._known[epoch] = committed
            for old in [e for e in self._known if e < epoch - 1]:
                del self._known[old]
        if committed <= self._committed.get(peer, 0):
            return
        self._committed[peer] = committed
        for k in sorted(k for k in self._verdicts if k < committed):
            self._grant(k)

    def _grant(self, n: int) -> None:
        verdict = self._verdicts.get(n)
        if verdict is not None and not verdict.done():
            verdict.set_result(True)
        # Older syncs are settled: forget them.
        for old in [k for k in self._finished if k < n]:
            del self._finished[old]
            self._verdicts.pop(old, None)

    def decided(self, epoch: int, n: int) -> bool:
        """The verdict on sync ``n`` of ``epoch`` for a member that asks once
        no new one can be given (the epoch is being replaced, or was): True
        if a member's heartbeat said it was committed, else False. A member
        the old coordinator granted a sync to has written it; refusing it to
        the others would leave them a step behind it."""
        return n < self._known.get(epoch, 0)

    def close(self) -> None:
        """The epoch is replaced (or the group over): every sync still open
        is refused, to every member that waits for it, and the ledger
        starts anew for the next epoch."""
        for verdict in self._verdicts.values():
            if not verdict.done():
                verdict.set_result(False)
        self._verdicts.clear()
        self._finished.clear()
        self._committed = {}
