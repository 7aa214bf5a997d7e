"""Transports move framed chunk messages between peers; algorithms never see grpc.

A transport offers outgoing streams to a destination rank (one per
collective and lane) and delivers incoming streams to the peer's
:class:`StreamHandler`, plus two small unary control messages (abort, ping).
Two implementations: :class:`~ferrogrpc.transport.grpc_streams.GrpcTransport` (the
real one, which is also the one place where grpc errors become ferrogrpc
errors) and :class:`MemoryTransport` here (in-process queues, for fast
deterministic tests).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from typing import Protocol

from ..errors import Evidence, PeerError

# How long a transport's close waits for the streams still ending in the
# background (OutStream.end) to land: a receiver that is gone or stopped
# costs this, once.
ENDING_GRACE_S = 0.25

SendHook = Callable[[int, bytes], bytes]
"""``hook(dst, message)`` may rewrite outgoing messages (fault injection)."""


class InStream(Protocol):
    async def read(self) -> bytes | None:
        """The next message, or None at the end of the stream."""
        ...


class OutStream(Protocol):
    async def write(self, message: bytes) -> None: ...

    async def close(self) -> None:
        """Finish the stream and wait until the receiver has consumed it."""
        ...

    def end(self) -> None:
        """Finish the stream in the background: its end goes out, and the
        receiver's answer is awaited, after this returns; a failure there
        only drops the stream (and its connection's reuse). For a stream
        whose receiver is known by other means to have what it needs (a
        ring's end markers). The transport's close gives the ends still
        pending a short grace to land."""
        ...

    def cancel(self) -> None: ...


class Replayed:
    """A stream with a message put in front of it: ``read()`` returns
    ``first``, then what ``rest`` has. The message is dropped once read, so
    that whoever holds the stream does not hold it too."""

    def __init__(self, first: bytes, rest: InStream) -> None:
        self._first: bytes | None = first
        self.rest = rest

    async def read(self) -> bytes | None:
        first, self._first = self._first, None
        return first if first is not None else await self.rest.read()

    def put_back(self, message: bytes) -> None:
        """Make ``message`` (the one just read) the next one read again."""
        assert self._first is None
        self._first = message


class StreamHandler(Protocol):
    async def handle_stream(self, stream: Replayed, origin: str) -> None:
        """Take an incoming stream, whose first message (its opening) is
        there to read (and may be put back); return once it has been consumed. Raising
        FerroGrpcError fails the stream at the sender with that message.
        The transport keeps no reference to the messages it hands over."""
        ...

    async def handle_abort(self, message: bytes) -> None: ...


class Transport(abc.ABC):
    """Moves bytes between ranks. ``start`` binds and returns the address to
    advertise; ``connect`` learns everyone's addresses."""

    addresses: list[str]

    def __init__(self) -> None:
        # Streams ending in the background (OutStream.end).
        self._ending: set[asyncio.Task[None]] = set()

    def _end_later(self, stream: OutStream) -> None:
        """``stream.close()`` in the background, for ``stream.end()``: a
        failure there is dropped (the stream's close drops what failed)."""

        async def end() -> None:
            with contextlib.suppress(Exception):
                await stream.close()

        task = asyncio.ensure_future(end())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def settle(self, grace: float) -> None:
        """Give the streams still ending in the background (OutStream.end)
        up to ``grace`` seconds to land: a right neighbour may still be
        reading this rank's last end markers."""
        if self._ending:
            await asyncio.wait(self._ending, timeout=grace)

    async def _stop_ending(self) -> None:
        """At close: the streams still ending get ENDING_GRACE_S, then stop."""
        await self.settle(ENDING_GRACE_S)
        for task in list(self._ending):
            task.cancel()
        if self._ending:
            await asyncio.wait(self._ending)

    @abc.abstractmethod
    async def start(self, handler: StreamHandler) -> str: ...

    def connect(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)

    @abc.abstractmethod
    async def open(self, dst: int, lane: int) -> OutStream: ...

    @abc.abstractmethod
    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None: ...

    @abc.abstractmethod
    async def ping(self, dst: int, timeout: float) -> None:
        """Return if ``dst`` answers within ``timeout``; raise PeerError if not
        (with Evidence.UNREACHABLE when ``dst`` cannot be reached at all)."""

    @abc.abstractmethod
    async def wall_clock(self, dst: int, timeout: float) -> float:
        """``dst``'s wall clock: its ``time.time()`` as it answered a ping
        (0.0 from a peer too old to say). A traced rank measures its clock
        offset to rank 0 with it (observe/clock.py)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class _MemoryInStream:
    def __init__(self, window: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=window)

    async def read(self) -> bytes | None:
        return await self.queue.get()


class _MemoryOutStream:
    def __init__(
        self,
        target: MemoryTransport,
        window: int,
        dst: int,
        hook: SendHook | None,
        owner: MemoryTransport,
    ) -> None:
        self._hook = hook
        self._owner = owner
        self._target = target
        self._window = window
        self._dst = dst
        self._stream: _MemoryInStream | None = None
        self._task: asyncio.Task[None] | None = None

    async def write(self, message: bytes) -> None:
        if self._hook is not None:
            message = self._hook(self._dst, message)
        if self._task is None:
            handler = self._target.handler
            if handler is None or self._target.closed:
                raise PeerError(f"sending: rank {self._dst} is not serving", peer=self._dst)
            self._stream = _MemoryInStream(self._window)
            self._task = asyncio.ensure_future(
                handler.handle_stream(Replayed(message, self._stream), "memory")
            )
            return
        assert self._stream is not None
        if self._task.done():
            await self._task  # re-raises the receiver's failure
            raise PeerError("sending: receiver finished early", peer=self._dst)
        if self._target.closed:
            # As a reset connection would: the receiving process is gone.
            self._task.cancel()
            raise PeerError(
                f"sending: rank {self._dst} is gone", peer=self._dst, evidence=Evidence.UNREACHABLE
            )
        await self._stream.queue.put(message)

    async def close(self) -> None:
        if self._task is None:
            return
        assert self._stream is not None
        if not self._task.done():
            # Room in the window for the end, unless the receiver ends first
            # (a full window is then never read).
            put = asyncio.ensure_future(self._stream.queue.put(None))
            try:
                await asyncio.wait([put, self._task], return_when=asyncio.FIRST_COMPLETED)
            finally:
                put.cancel()
        # Shielded: a close cancelled (its caller's timeout, an end in the
        # background stopped) leaves the receiver to its own end.
        await asyncio.shield(self._task)

    def end(self) -> None:
        self._owner._end_later(self)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


class MemoryTransport(Transport):
    """In-process transport: bounded asyncio queues stand in for HTTP/2 streams.
    Peers find each other through a shared registry dict."""

    _ids = itertools.count()

    def __init__(self, registry: dict[str, MemoryTransport], window: int = 4) -> None:
        super().__init__()
        self._registry = registry
        self._window = window
        self.send_hook: SendHook | None = None
        self.handler: StreamHandler | None = None
        self.closed = False
        # Tests set this to stand for a stopped process: pings go unanswered.
        self.frozen = False
        self.addresses = []

    async def start(self, handler: StreamHandler) -> str:
        self.handler = handler
        address = f"memory:{next(self._ids)}"
        self._registry[address] = self
        return address

    def _target(self, dst: int) -> MemoryTransport:
        target = self._registry.get(self.addresses[dst])
        if target is None:
            raise PeerError(
                f"rank {dst} is gone",
                peer=dst,
                peer_address=self.addresses[dst],
                evidence=Evidence.UNREACHABLE,
            )
        return target

    async def open(self, dst: int, lane: int) -> OutStream:
        return _MemoryOutStream(self._target(dst), self._window, dst, self.send_hook, self)

    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None:
        target = self._target(dst)
        if target.handler is not None and not target.closed:
            await target.handler.handle_abort(message)

    async def ping(self, dst: int, timeout: float) -> None:
        target = self._target(dst)
        if target.closed or target.handler is None:
            raise PeerError(f"rank {dst} is gone", peer=dst, evidence=Evidence.UNREACHABLE)
        if target.frozen:
            await asyncio.sleep(timeout)
            raise PeerError(f"rank {dst} did not answer a ping", peer=dst)

    async def wall_clock(self, dst: int, timeout: float) -> float:
        await self.ping(dst, timeout)
        return time.time()  # every rank in this process reads the same clock

    async def close(self) -> None:
        await self._stop_ending()
        self.closed = True
        for address, transport in list(self._registry.items()):
            if transport is self:
                del self._registry[address]
