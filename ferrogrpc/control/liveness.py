"""A process's liveness as its coordinator sees it: one stream, open for as
long as the process lives (see [Note: a stream for a lifetime]).

[Note: a stream for a lifetime] A member's heartbeats say it is alive; their
absence says so only after the heartbeat timeout, which must be long
enough for a busy or slowed member (seconds, often ten). A SIGKILLed or
crashed process is gone at once, and its kernel says so: it closes the
process's TCP connections. So every elastic process also holds one Watch
call to the coordinator open for its whole life, carrying its peer id.

- When that call ends without the process having said it leaves (the
  coordinator's handler is cancelled: its connection was reset or closed),
  the coordinator waits a short grace (a live process whose call broke
  reconnects within it) and then takes the process for silent at once, as
  if its heartbeat timeout had passed: the next check drops it from its
  epoch (RECOVER) or from the forming round.
- While a RECOVER round forms, the grace is not waited out: a member's
  collective failed, and a call that ended is its likely cause (the
  survivors cannot name it: see below). A call ending then is taken for
  gone at once, and so are the calls already in their grace when the round
  opens (``hurry``).
- A process that is stopped (SIGSTOP), slowed or cut off by the network
  keeps its connection open: only the heartbeat timeout finds it, as
  before.
- A connection closed by a live process is not taken for its death: a
  survivor cannot tell a dead peer's closed connection from a live one that
  moved on to the next epoch, but the coordinator's Watch lasts across
  epochs.
- A coordinator that does not know the call (an older one) answers
  UNIMPLEMENTED, and the process stops asking: the heartbeat timeout
  alone finds its death then.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

logger = logging.getLogger("ferrogrpc.coordinator")

# How long a process whose Watch ended has to open another before it is
# taken for gone (at most; a quarter of the heartbeat timeout if shorter).
GRACE_S = 1.0
# How long a process waits before it opens its Watch again.
RETRY_S = 0.2


class Watches:
    """The coordinator's side: one Watch call per live process, by peer id.
    ``gone(peer)`` is called (on the coordinator's loop) once a process's
    call ended and no other opened within the grace."""

    def __init__(
        self,
        gone: Callable[[str], None],
        heartbeat_timeout: float,
        urgent: Callable[[], bool] = lambda: False,
    ) -> None:
        self._gone = gone
        self._urgent = urgent
        self.grace = min(GRACE_S, heartbeat_timeout / 4)
        # The latest call's number, by peer id (a newer call replaces it).
        self._calls: dict[str, int] = {}
        # The calls that ended and wait out their grace: (timer, number).
        self._pending: dict[str, tuple[asyncio.Handle, int]] = {}
        self._next = 0
        self._stopping = False

    async def hold(self, peer: str) -> AsyncIterator[bytes]:
        """The Watch call of ``peer``: sends nothing, ends with the call."""
        self._next += 1
        number = self._calls[peer] = self._next
        ended = self._pending.pop(peer, None)
        if ended is not None:
            ended[0].cancel()  # it opened another call within the grace: alive
        try:
            await asyncio.Event().wait()
        finally:
            if not self._stopping and self._calls.get(peer) == number:
                loop = asyncio.get_running_loop()
                # While a RECOVER round forms (a collective failed), a call
                # that ends is that failure's likely cause: no grace.
                wait = 0.0 if self._urgent() else self.grace
                self._pending[peer] = (loop.call_later(wait, self._ended, peer, number), number)
        yield b""  # (never reached: makes this an async generator)

    def hurry(self) -> None:
        """A RECOVER round opened (a member's collective failed): the calls
        that ended and wait out their grace end it now, as the failure's
        likely cause. A live process whose call broke at that moment is
        dropped and enters again; a stopped one, whose call holds, is not."""
        if not self._pending:
            return
        loop = asyncio.get_running_loop()
        for peer, (timer, number) in list(self._pending.items()):
            timer.cancel()
            self._pending[peer] = (loop.call_soon(self._ended, peer, number), number)

    def _ended(self, peer: str, number: int) -> None:
        pending = self._pending.get(peer)
        if pending is not None and pending[1] == number:
            del self._pending[peer]
        if self._stopping or self._calls.get(peer) != number:
            return  # it opened another call meanwhile: alive
        del self._calls[peer]
        logger.info("a process's Watch call ended (peer %s...): taken for gone", peer[:8])
        self._gone(peer)

    def stop(self) -> None:
        """The coordinator stops: the calls it ends say nothing of anyone."""
        self._stopping = True


class Watcher:
    """A process's side: holds its Watch call open on a thread of its own,
    and opens another whenever one ends, until ``close()``."""

    def __init__(self, open_call: Callable[[], Any]) -> None:
        self._open = open_call
        self._call: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferrogrpc-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._stop.is_set():
                    return
                self._call = call = self._open()
            try:
                for _ in call:
                    pass
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("the coordinator has no Watch call: deaths wait for silence")
                    return
            self._stop.wait(RETRY_S)

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            if self._call is not None:
                self._call.cancel()
        self._thread.join(timeout=5)
