"""Staging device tensors (CUDA) through host memory, overlapped with streaming.

The ring runs on a host buffer. For a CUDA tensor:

- At call time, on the caller's thread, a private copy stream first waits for
  the caller's current stream (so every kernel that produced the tensor is
  done), then copies the tensor into a pinned host buffer chunk by chunk,
  recording an event after each chunk. The sender waits only for the event of
  the chunk it is about to send, so the device-to-host copy of chunk k+1
  overlaps the network send of chunk k.
- As soon as a range of the result is final on the host (a chunk copied in
  by all-gather, or the last reduction of a segment), its host-to-device copy
  is queued on the copy stream, so results flow back while later chunks are
  still arriving.
- At the end the caller's stream waits for the copy stream, so the result is
  ordered with the caller's later kernels, exactly as if a kernel had written
  it; the call returns once the copies have completed, so that the pinned
  buffers can be reused.

Reductions run on the host, in the pinned buffer: the received chunk is
already there, and reducing on the device would cost a copy up and a copy
back per chunk over PCIe, against one memory-bound add at host speed.

Pinned buffers are reused across calls (:class:`PinnedPool`). All device work
goes through a :class:`Copier`, so the logic is tested on the CPU with a
deliberately lazy copier.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch


class Copier(abc.ABC):
    """Asynchronous copies between a device and the host, in issue order."""

    @abc.abstractmethod
    def begin(self) -> None:
        """Order the following copies after the caller's pending device work."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Queue ``dst.copy_(src)``; return a ticket to wait on."""

    @abc.abstractmethod
    async def wait(self, ticket: Any) -> None:
        """Return once the copy behind ``ticket`` (and all before it) is done."""

    @abc.abstractmethod
    def publish(self) -> Any:
        """Make the caller's stream wait for every copy queued so far; return
        a ticket for them."""

    def keep_alive(self, tensor: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Tell the device allocator that ``tensor`` is in use by the copies."""

    @abc.abstractmethod
    def then(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` (device work) on the caller's stream, after the copies."""


class CudaCopier(Copier):
    """Copies on a private CUDA stream, with one event per copy."""

    _streams: ClassVar[dict[int, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.user_stream = torch.cuda.current_stream(self.device)
        with CudaCopier._lock:
            stream = CudaCopier._streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                CudaCopier._streams[index] = stream
        self.stream = stream

    def begin(self) -> None:
        self.stream.wait_stream(self.user_stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return event

    async def wait(self, ticket: Any) -> None:
        if not ticket.query():
            await asyncio.get_running_loop().run_in_executor(None, ticket.synchronize)

    def publish(self) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        self.user_stream.wait_event(event)
        return event

    def keep_alive(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.stream)

    def then(self, fn: Callable[[], object]) -> None:
        with torch.cuda.stream(self.user_stream):
            fn()


class PinnedPool:
    """Page-locked host buffers reused across calls, by power-of-two size."""

    def __init__(self, pin: bool = True, keep_per_size: int = 2) -> None:
        self.pin = pin
        self.keep = keep_per_size
        self._free: dict[int, list[torch.Tensor]] = {}
        # Callers acquire on their own threads; buffers come back on the loop.
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.numel(), [])
            if len(free) < self.keep:
                free.append(buffer)


def host_view(raw: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return raw[: numel * itemsize].view(dtype)


class Stage:
    """One collective's staging: a host buffer for the ring, loaded from the
    device in chunks and written back range by range.

    ``load`` is the device tensor (flat) whose contents the ring starts from,
    placed at element ``load_at`` of the host buffer (None: nothing to load).
    ``store`` is the device tensor (flat) that receives final ranges; final
    host range [lo, hi) of ``result`` goes to ``store[lo - store_at : hi - store_at]``.
    """

    def __init__(
        self,
        copier: Copier,
        pool: PinnedPool,
        host: torch.Tensor,
        *,
        load: torch.Tensor | None,
        load_at: int,
        store: torch.Tensor | None,
        result: torch.Tensor,
        store_at: int,
        chunk_elems: int,
        release: list[torch.Tensor],
    ) -> None:
        self.copier = copier
        self.pool = pool
        self.host = host
        self.result = result
        self.store = store
        self.store_at = store_at
        self.chunk_elems = chunk_elems
        self.finished = False
        self._release = release
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._tickets: list[Any] = []
        self._done: list[bool] = []
        copier.begin()
        if store is not None and store.numel():
            copier.keep_alive(store)
        if load is not None:
            self.load_range(load, load_at)

    def load_range(self, load: torch.Tensor, at: int) -> None:
        """Queue the device-to-host copy of ``load`` into host[at:], in chunks
        (call in increasing ``at`` order)."""
        if not load.numel():
            return
        self.copier.keep_alive(load)
        n = load.numel()
        for lo in range(0, n, self.chunk_elems):
            hi = min(lo + self.chunk_elems, n)
            ticket = self.copier.copy(self.host[at + lo : at + hi], load[lo:hi])
            self._starts.append(at + lo)
            self._ends.append(at + hi)
            self._tickets.append(ticket)
            self._done.append(False)

    async def ready(self, lo: int, hi: int) -> None:
        """Wait until host range [lo, hi) holds the loaded input."""
        if not self._tickets or hi <= lo:
            return
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._tickets) and self._starts[i] < hi:
            if not self._done[i] and self._ends[i] > lo:
                await self.copier.wait(self._tickets[i])
                # Copies complete in issue order.
                for j in range(i + 1):
                    self._done[j] = True
            i += 1

    def final(self, lo: int, hi: int) -> None:
        """Host range [lo, hi) of the result is final: send it to the device."""
        if self.store is None or hi <= lo:
            return
        a, b = lo - self.store_at, hi - self.store_at
        self.copier.copy(self.store[a:b], self.result[a:b])

    async def finish(self) -> None:
        """Order the caller's stream after every copy, wait for them, then
        recycle the host buffers."""
        self.finished = True
        ticket = self.copier.publish()
        await self.copier.wait(ticket)
        for buf in self._release:
            self.pool.release(buf)
        self._release = []

    async def abandon(self) -> None:
        """After a failure: let queued copies drain; the buffers are dropped."""
        self.finished = True
        ticket = self.copier.publish()
        await self.copier.wait(ticket)
        self._release = []
