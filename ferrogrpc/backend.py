"""The blocking facade for training code: ``init_backend``, ``Backend`` and
``Work``. One private event-loop thread per Backend runs the asyncio Peer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import os
import threading
from collections.abc import Coroutine
from typing import Any, Generic, Literal, TypeVar, overload

import torch

from ._intraop import limit_thread_intraop, loop_thread_count
from ._malloc import tune_allocator
from .errors import CollectiveTimeoutError, ConfigError, FerroGrpcError, RendezvousError
from .ops import ReduceOp
from .options import (
    ADVERTISE_HOST_ENV,
    BIND_HOST_ENV,
    COORDINATOR_ENV,
    PORT_ENV,
    TOKEN_ENV,
    ChunkPolicy,
    Timeouts,
    TLSConfig,
)
from .peer import Peer
from .rendezvous import Rendezvous, StoreRendezvous, route_host

T = TypeVar("T")


class Work(Generic[T]):
    """A collective in flight, as returned with ``async_op=True``.

    ``wait()`` blocks until it finishes and returns what the blocking call
    would have returned, or raises its error. Several Works may be in flight
    at once, from any threads.
    """

    def __init__(self, future: concurrent.futures.Future[T], name: str) -> None:
        self._future = future
        self._name = name

    def wait(self, timeout: float | None = None) -> T:
        """Wait for the result. With ``timeout``, raise CollectiveTimeoutError if
        it has not finished by then (the collective itself goes on)."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            # That is the builtin TimeoutError, which CollectiveTimeoutError
            # also is: the collective's own error passes through as it is.
            if isinstance(exc, FerroGrpcError):
                raise
            raise CollectiveTimeoutError(
                f"Work.wait timed out after {timeout:g}s; the collective is still running",
                op=self._name,
            ) from None

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        """The error, once completed (None on success)."""
        return self._future.exception() if self._future.done() else None


class Backend:
    """Blocking collectives for synchronous training code.

    Thread-safe: autograd hooks may call it from the backward thread while
    the main thread does too. Every collective is a synchronization point
    (see :class:`Peer`); its sequence number is taken when it is called, so
    all ranks must *call* collectives in the same order. With
    ``async_op=True`` a call returns a :class:`Work` at once.

    On failure a call raises the FerroGrpcError that names the rank, peer,
    op and sequence number; the backend is then broken and every later call
    raises at once with that cause. ``close()`` always works and is
    idempotent.
    """

    def __init__(
        self,
        peer: Peer,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        rendezvous: object | None = None,
    ) -> None:
        self._peer = peer
        self._loop = loop
        self._thread = thread
        self._rendezvous = rendezvous
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self._peer.rank

    @property
    def world_size(self) -> int:
        return self._peer.world_size

    @property
    def peer(self) -> Peer:
        """The asyncio peer underneath (runs on the backend's loop thread)."""
        return self._peer

    @property
    def address(self) -> str:
        return self._peer.address

    def _submit(self, coro: Coroutine[Any, Any, T], name: str, async_op: bool) -> T | Work[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                f"{name} was called from the backend's own event-loop thread; use the Peer's "
                "coroutines there"
            )
        with self._close_lock:
            # Under the lock, so that close() cannot stop the loop between the
            # check and the hand-off (the work would never run).
            if self._closed:
                coro.close()
                raise ConfigError(
                    "this backend is closed", rank=self.rank, world_size=self.world_size, op=name
                )
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        work = Work(future, name)
        return work if async_op else work.wait()

    def _check(self) -> None:
        if self._closed:
            raise ConfigError(
                "this backend is closed", rank=self._peer.rank, world_size=self.world_size
            )

    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | str = ..., *, async_op: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | str = ..., *, async_op: Literal[True]
    ) -> Work[torch.Tensor]: ...
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduce ``tensor`` in place across ranks; returns it. See Peer.all_reduce."""
        self._check()
        return self._submit(self._peer.all_reduce(tensor, op), "all_reduce", async_op)

    def _all_reduce_after(
        self, tensor: torch.Tensor, op: ReduceOp | str, after: Work[Any] | None
    ) -> Work[torch.Tensor]:
        """``all_reduce(async_op=True)`` whose transfer starts only once
        ``after`` has finished (either way). Its sequence number is taken now,
        so the order across ranks is the call order. DDP runs its buckets one
        at a time this way: collectives in flight together cost more CPU (a
        thread wake-up per message per stream) than they save."""
        self._check()
        coro = self._peer.all_reduce(tensor, op)
        previous = after._future if after is not None else None

        async def run() -> torch.Tensor:
            if previous is not None:
                try:
                    await asyncio.wait([asyncio.wrap_future(previous)])
                except asyncio.CancelledError:
                    coro.close()  # never started (the loop is shutting down)
                    raise
            # Runs even when ``previous`` failed: it then fails at once with
            # the same cause, and releases what the call set up.
            return await coro

        try:
            work = self._submit(run(), "all_reduce", True)
        except BaseException:
            coro.close()
            raise
        assert isinstance(work, Work)
        return work

    @overload
    def all_gather(
        self, tensor: torch.Tensor, *, async_op: Literal[False] = ...
    ) -> list[torch.Tensor]: ...
    @overload
    def all_gather(
        self, tensor: torch.Tensor, *, async_op: Literal[True]
    ) -> Work[list[torch.Tensor]]: ...
    def all_gather(
        self, tensor: torch.Tensor, *, async_op: bool = False
    ) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
        """One tensor per rank, in rank order. See Peer.all_gather."""
        self._check()
        return self._submit(self._peer.all_gather(tensor), "all_gather", async_op)

    @overload
    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor, *, async_op: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor, *, async_op: Literal[True]
    ) -> Work[torch.Tensor]: ...
    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Gather into ``out``, rank-major. See Peer.all_gather_into_tensor."""
        self._check()
        return self._submit(
            self._peer.all_gather_into_tensor(out, tensor), "all_gather_into_tensor", async_op
        )

    @overload
    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp | str = ..., *, async_op: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp | str = ..., *, async_op: Literal[True]
    ) -> Work[torch.Tensor]: ...
    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """This rank's reduced part. See Peer.reduce_scatter."""
        self._check()
        return self._submit(self._peer.reduce_scatter(tensor, op), "reduce_scatter", async_op)

    @overload
    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[False] = ...,
    ) -> torch.Tensor: ...
    @overload
    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[True],
    ) -> Work[torch.Tensor]: ...
    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduce into ``out``. See Peer.reduce_scatter_tensor."""
        self._check()
        return self._submit(
            self._peer.reduce_scatter_tensor(out, tensor, op), "reduce_scatter_tensor", async_op
        )

    @overload
    def broadcast(
        self, tensor: torch.Tensor, root: int = ..., *, async_op: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def broadcast(
        self, tensor: torch.Tensor, root: int = ..., *, async_op: Literal[True]
    ) -> Work[torch.Tensor]: ...
    def broadcast(
        self, tensor: torch.Tensor, root: int = 0, *, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Copy root's tensor into every rank's, in place. See Peer.broadcast."""
        self._check()
        return self._submit(self._peer.broadcast(tensor, root), "broadcast", async_op)

    def barrier(self) -> None:
        """Return once every rank has entered. Synchronization point."""
        self._check()
        self._submit(self._peer.barrier(), "barrier", False)

    def close(self) -> None:
        """Close the peer, stop the loop thread. Idempotent; safe after a failure."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._peer.close(), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError, FerroGrpcError):
                future.result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        self._rendezvous = None

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ferrogrpc.Backend rank {self.rank}/{self.world_size} {self.address} {state}>"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _start_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    threads = loop_thread_count()
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        limit_thread_intraop(threads)
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    thread = threading.Thread(target=run, name="ferrogrpc-loop", daemon=True)
    thread.start()
    ready.wait()
    return loop, thread


def init_backend(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    coordinator: str | None = None,
    timeouts: Timeouts | None = None,
    chunk_policy: ChunkPolicy | None = None,
    bind_host: str | None = None,
    advertise_host: str | None = None,
    port: int | None = None,
    checksum: bool | str | None = None,
    tls: TLSConfig | None = None,
    token: str | None = None,
) -> Backend:
    """Join the group and return a blocking :class:`Backend`.

    Arguments left None are read from ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``, and the rendezvous is torch's env://
    TCPStore at ``master_addr:master_port`` (hosted by rank 0, or by torchrun's
    agent under ``TORCHELASTIC_USE_AGENT_STORE=True``). With
    ``FERROGRPC_COORDINATOR=host:port`` (or ``coordinator=``) the coordinator
    assigns the rank and world size instead.

    The gRPC server binds ``bind_host`` (``FERROGRPC_BIND_HOST``; default
    127.0.0.1 when the master is on loopback, else 0.0.0.0) on ``port``
    (``FERROGRPC_PORT``; default an ephemeral port) and advertises
    ``advertise_host`` (``FERROGRPC_ADVERTISE_HOST``; default the local
    address that routes to the master).

    Security: ``tls`` (or ``FERROGRPC_TLS_CERT``/``_KEY``/``_CA``) turns on
    mutual TLS between peers; ``token`` (or ``FERROGRPC_TOKEN``) makes every
    peer refuse RPCs that do not carry the shared token. Chunks carry a
    CRC-32 unless ``checksum=False`` (``FERROGRPC_CHECKSUM=0``);
    ``checksum="crc32c"`` picks CRC32C instead (all ranks must agree; a
    ConfigError names an unknown choice).

    Returns once every rank has joined and the ring has passed a barrier.
    Raises RendezvousError or CollectiveTimeoutError if that does not happen
    within ``timeouts.connect``.
    """
    timeouts = timeouts or Timeouts.from_env()
    chunk_policy = chunk_policy or ChunkPolicy.from_env()
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or None
    rendezvous: Rendezvous
    if coordinator:
        from .coordinator import CoordinatorRendezvous

        rendezvous = CoordinatorRendezvous(coordinator, timeout=timeouts.connect)
        target_host = coordinator.rsplit(":", 1)[0]
    else:
        store = StoreRendezvous.from_env(
            rank, world_size, master_addr, master_port, timeout=timeouts.connect
        )
        rendezvous = store
        target_host = store.master_addr
    bind = (
        bind_host
        or os.environ.get(BIND_HOST_ENV)
        or ("127.0.0.1" if _is_loopback(target_host) else "0.0.0.0")
    )
    advertise = (
        advertise_host
        or os.environ.get(ADVERTISE_HOST_ENV)
        or ("127.0.0.1" if _is_loopback(target_host) else route_host(target_host))
    )
    bind_port = port if port is not None else int(os.environ.get(PORT_ENV, "0") or 0)
    from .integrity import resolve_checksum

    # Before the loop thread allocates anything: it is to share one arena.
    tune_allocator()
    loop, thread = _start_loop()
    start = Peer.start(
        rank,
        world_size,
        rendezvous=rendezvous,
        bind_host=bind,
        port=bind_port,
        advertise_host=advertise,
        timeouts=timeouts,
        chunk_policy=chunk_policy,
        checksum=resolve_checksum(checksum),
        tls=tls if tls is not None else TLSConfig.from_env(),
        token=token if token is not None else (os.environ.get(TOKEN_ENV) or None),
    )
    starting = asyncio.run_coroutine_threadsafe(start, loop)
    try:
        peer = starting.result(timeout=timeouts.connect + 30)
    except BaseException as exc:
        # Cancelling the start closes whatever it had bound (Peer.start cleans
        # up on any exception, cancellation included).
        starting.cancel()
        with contextlib.suppress(BaseException):
            starting.result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if isinstance(exc, TimeoutError) and not isinstance(exc, FerroGrpcError):
            raise RendezvousError(
                f"the group did not form within {timeouts.connect + 30:g}s"
            ) from exc
        raise
    return Backend(peer, loop, thread, rendezvous)
