"""The blocking facade for training code: ``Backend``, and starting one
(``start_backend``: its private event-loop thread, which runs the asyncio
Peer). ``init_backend`` (ferrogrpc/startup.py) picks the rendezvous and calls it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, Literal, TypeVar, cast, overload

import torch

from ..algorithms.quantized import ErrorFeedback
from ..control.rendezvous import Rendezvous, route_host
from ..env import Settings
from ..errors import ConfigError, FerroGrpcError, RendezvousError
from ..ops import ReduceOp
from .allocator import tune_for
from .call import Call
from .peer import Peer
from .threads import limit_thread_intraop
from .work import Work

T = TypeVar("T")


async def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task left on ``loop`` but this one, wait for them to end
    (bounded by the caller), then close its async generators."""
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks(loop) if t is not me and not t.done()]
    for task in left:
        task.cancel()
    if left:
        await asyncio.gather(*left, return_exceptions=True)
    await loop.shutdown_asyncgens()


class Backend:
    """Blocking collectives for synchronous training code; made by
    :func:`~ferrogrpc.init_backend`.

    Thread-safe: autograd hooks may call it from the backward thread while
    the main thread does too. A private event-loop thread runs the asyncio
    :class:`Peer` underneath; a small collective on one host runs in the
    calling thread itself.

    Synchronizes: every collective (``all_reduce``, ``all_gather``,
    ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``,
    ``all_reduce_coalesced``, ``broadcast``, ``barrier``,
    ``all_to_all_single``) is a synchronization point: all ranks call it, in
    the same order, with matching shapes, dtypes, ops and roots. Its
    sequence number is taken when it is *called*, so with ``async_op=True``
    (a :class:`Work` returned at once) the call order is still the order.
    ``send`` and ``recv`` are between two ranks only.

    Attributes:
        rank, world_size: this rank, and the group's size.
        address: the gRPC address this rank advertises.
        data_path: ``"shared memory"``, ``"two-level"`` or ``"grpc"``.
        peer: the asyncio :class:`Peer` underneath.

    Raises:
        ConfigError: bad arguments (on this rank; every other rank's call of
            the same collective fails at once naming this rank), or a call
            after ``close()``.
        ProtocolError: the ranks disagree (sizes, dtypes, ops, roots), or a
            peer sent bad or corrupt data; every rank raises it.
        PeerError: a peer failed, exited or is unreachable; every surviving
            rank raises it, naming it.
        CollectiveTimeoutError: a peer stalled past the idle timeout, or the
            collective passed its deadline.

    On failure the backend is *broken*: every later call raises at once
    with the cause (a refusal of bad arguments is not a failure: the group
    goes on). ``close()`` always works and is idempotent.
    """

    def __init__(
        self,
        peer: Peer,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
    ) -> None:
        self._peer = peer
        # The peer's lifecycle (see [Note: peer lifecycle]): closing refuses
        # every call from here on, from any thread.
        self._life = peer._life
        self._loop = loop
        self._thread = thread
        # Whether close() has stopped (or is stopping) the loop thread.
        self._thread_stopped = False
        self._close_lock = threading.Lock()

    @property
    def rank(self) -> int:
        """This process's rank, 0 to ``world_size - 1``."""
        return self._peer.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self._peer.world_size

    @property
    def peer(self) -> Peer:
        """The asyncio peer underneath (runs on the backend's loop thread)."""
        return self._peer

    @property
    def address(self) -> str:
        """The ``host:port`` other ranks dial for this rank's peer."""
        return self._peer.address

    @property
    def data_path(self) -> str:
        """``"shared memory"``, ``"two-level"`` or ``"grpc"``: see
        :attr:`Peer.data_path`."""
        return self._peer.data_path

    def submit(self, coro: Coroutine[Any, Any, T], name: str, async_op: bool) -> T | Work[T]:
        """Run a coroutine of :attr:`peer`'s (a collective, or several in
        sequence) on the backend's loop thread; return its result, or with
        ``async_op`` a :class:`Work` for it."""
        return self._submit(coro, name, async_op)

    def _submit(self, coro: Coroutine[Any, Any, T], name: str, async_op: bool) -> T | Work[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                f"{name} was called from the backend's own event-loop thread; use the Peer's "
                "coroutines there"
            )
        if not async_op and isinstance(coro, Call) and not self._life.closing:
            # A small collective on one host, in this thread (direct.py).
            done, value = coro.run_here()
            if done:
                return cast(T, value)
        with self._close_lock:
            # Under the lock, so that close() cannot stop the loop between the
            # check and the hand-off (the work would never run).
            if self._life.closing:
                coro.close()
                raise ConfigError(
                    "this backend is closed", rank=self.rank, world_size=self.world_size, op=name
                )
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        work = Work(future, name)
        return work if async_op else work.wait()

    def _check(self) -> None:
        if self._life.closing:
            raise ConfigError(
                "this backend is closed", rank=self._peer.rank, world_size=self.world_size
            )

    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[False] = ...,
        after: Work[Any] | None = ...,
        wire_dtype: torch.dtype | None = ...,
        feedback: ErrorFeedback | None = ...,
    ) -> torch.Tensor: ...
    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[True],
        after: Work[Any] | None = ...,
        wire_dtype: torch.dtype | None = ...,
        feedback: ErrorFeedback | None = ...,
    ) -> Work[torch.Tensor]: ...
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        after: Work[Any] | None = None,
        wire_dtype: torch.dtype | None = None,
        feedback: ErrorFeedback | None = None,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduce ``tensor`` in place across ranks; returns it. See
        Peer.all_reduce (which also explains ``wire_dtype``).

        ``wire_dtype=torch.int8`` (float32 and float64 tensors, sum or mean):
        blockwise-scaled int8 on the wire, each value rounded twice whatever
        the world size, the same on every rank; see Peer.all_reduce.
        ``torch.int4``: the same in 4 bits (half the bytes, 18 times the
        bound). ``feedback`` (an ``ErrorFeedback``, int8 or int4) carries the rounding
        errors into the next call on the same tensor, as DDP's
        ``compression="int8"`` does.

        ``after``: start the transfer only once that Work has finished
        (either way). The sequence number is still taken now, so the order
        across ranks is the call order. DDP runs its buckets one at a time
        this way: collectives in flight together cost more CPU (a thread
        wake-up per message per stream) than they save. If ``after`` failed,
        this one fails at once with the same cause.
        """
        self._check()
        coro = self._peer.all_reduce(tensor, op, wire_dtype=wire_dtype, feedback=feedback)
        if after is None:
            return self._submit(coro, "all_reduce", async_op)
        previous = after._future

        async def run() -> torch.Tensor:
            waited = asyncio.wrap_future(previous)
            try:
                await asyncio.wait([waited])
                if not waited.cancelled():
                    waited.exception()  # taken: its owner's Work raises it
            except asyncio.CancelledError:
                coro.close()  # never started (the loop is shutting down)
                raise
            # Runs even when ``previous`` failed: it then fails at once with
            # the same cause, and releases what the call set up.
            return await coro

        try:
            return self._submit(run(), "all_reduce", async_op)
        except BaseException:
            coro.close()
            raise

    @overload
    def all_gather(
        self,
        tensor: torch.Tensor,
        *,
        async_op: Literal[False] = ...,
        wire_dtype: torch.dtype | None = ...,
    ) -> list[torch.Tensor]: ...
    @overload
    def all_gather(
        self,
        tensor: torch.Tensor,
        *,
        async_op: Literal[True],
        wire_dtype: torch.dtype | None = ...,
    ) -> Work[list[torch.Tensor]]: ...
    def all_gather(
        self,
        tensor: torch.Tensor,
        *,
        async_op: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
        """One tensor per rank, in rank order. See Peer.all_gather."""
        self._check()
        coro = self._peer.all_gather(tensor, wire_dtype=wire_dtype)
        return self._submit(coro, "all_gather", async_op)

    @overload
    def all_gather_into_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        *,
        async_op: Literal[False] = ...,
        wire_dtype: torch.dtype | None = ...,
    ) -> torch.Tensor: ...
    @overload
    def all_gather_into_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        *,
        async_op: Literal[True],
        wire_dtype: torch.dtype | None = ...,
    ) -> Work[torch.Tensor]: ...
    def all_gather_into_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        *,
        async_op: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Gather into ``out``, rank-major. See Peer.all_gather_into_tensor."""
        self._check()
        coro = self._peer.all_gather_into_tensor(out, tensor, wire_dtype=wire_dtype)
        return self._submit(coro, "all_gather_into_tensor", async_op)

    @overload
    def reduce_scatter(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[False] = ...,
        wire_dtype: torch.dtype | None = ...,
    ) -> torch.Tensor: ...
    @overload
    def reduce_scatter(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[True],
        wire_dtype: torch.dtype | None = ...,
    ) -> Work[torch.Tensor]: ...
    def reduce_scatter(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """This rank's reduced part. See Peer.reduce_scatter."""
        self._check()
        coro = self._peer.reduce_scatter(tensor, op, wire_dtype=wire_dtype)
        return self._submit(coro, "reduce_scatter", async_op)

    @overload
    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[False] = ...,
        wire_dtype: torch.dtype | None = ...,
    ) -> torch.Tensor: ...
    @overload
    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[True],
        wire_dtype: torch.dtype | None = ...,
    ) -> Work[torch.Tensor]: ...
    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Reduce into ``out``. See Peer.reduce_scatter_tensor."""
        self._check()
        coro = self._peer.reduce_scatter_tensor(out, tensor, op, wire_dtype=wire_dtype)
        return self._submit(coro, "reduce_scatter_tensor", async_op)

    @overload
    def all_reduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[False] = ...,
        wire_dtype: torch.dtype | None = ...,
    ) -> list[torch.Tensor]: ...
    @overload
    def all_reduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp | str = ...,
        *,
        async_op: Literal[True],
        wire_dtype: torch.dtype | None = ...,
    ) -> Work[list[torch.Tensor]]: ...
    def all_reduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor] | Work[list[torch.Tensor]]:
        """All-reduce several tensors in place, as one collective per dtype
        and device. See Peer.all_reduce_coalesced."""
        self._check()
        coro = self._peer.all_reduce_coalesced(tensors, op, wire_dtype=wire_dtype)
        return self._submit(coro, "all_reduce_coalesced", async_op)

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

    @overload
    def barrier(self, *, async_op: Literal[False] = ...) -> None: ...
    @overload
    def barrier(self, *, async_op: Literal[True]) -> Work[None]: ...
    def barrier(self, *, async_op: bool = False) -> Work[None] | None:
        """Return once every rank has entered. Synchronization point."""
        self._check()
        return self._submit(self._peer.barrier(), "barrier", async_op)

    def all_to_all_single(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Rows of ``tensor`` to every rank, rows from every rank into
        ``out``. See Peer.all_to_all_single."""
        self._check()
        coro = self._peer.all_to_all_single(out, tensor, out_splits, in_splits)
        return self._submit(coro, "all_to_all", async_op)

    def send(
        self, tensor: torch.Tensor, dst: int, tag: int = 0, *, async_op: bool = False
    ) -> Work[None] | None:
        """Send ``tensor`` to rank ``dst`` (not a collective). See Peer.send."""
        self._check()
        return self._submit(self._peer.send(tensor, dst, tag), "send", async_op)

    def recv(
        self, tensor: torch.Tensor, src: int, tag: int = 0, *, async_op: bool = False
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Receive the matching message from ``src`` into ``tensor``. See
        Peer.recv."""
        self._check()
        return self._submit(self._peer.recv(tensor, src, tag), "recv", async_op)

    def recv_any(
        self, tensor: torch.Tensor, tag: int = 0, *, async_op: bool = False
    ) -> int | Work[int]:
        """Receive the next message with ``tag`` from any rank into
        ``tensor``; returns the sender's rank. See Peer.recv_any."""
        self._check()
        return self._submit(self._peer.recv_any(tensor, tag), "recv", async_op)

    def close(self) -> None:
        """Close the peer, stop the loop thread. Idempotent; safe after a failure."""
        with self._close_lock:
            began = self._life.begin_close()  # every call refused from here on
            if self._thread_stopped:
                return
            self._thread_stopped = True
        if self._loop.is_running():
            if began:
                future = asyncio.run_coroutine_threadsafe(self._peer._shutdown(), self._loop)
                with contextlib.suppress(concurrent.futures.TimeoutError, FerroGrpcError):
                    future.result(timeout=10)
            # What the peer's close left on the loop (gRPC's handler tasks
            # for RPCs the server cancelled) is cancelled and run to its end
            # here: a task destroyed while pending keeps gRPC call objects,
            # its poller thread and sockets alive until a garbage collection.
            drained = asyncio.run_coroutine_threadsafe(_drain(self._loop), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                drained.result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self._life.state.value
        return f"<ferrogrpc.Backend rank {self.rank}/{self.world_size} {self.address} {state}>"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _start_loop(threads: int) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
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


def prepare(
    s: Settings, target_host: str
) -> tuple[str, str, asyncio.AbstractEventLoop, threading.Thread]:
    """Where a rank binds and what it advertises, as ``target_host`` (the
    master's or the coordinator's host) calls for; then the allocator
    tuning and the loop thread. Returns (bind, advertise, loop, thread)."""
    loopback = _is_loopback(target_host)
    bind = s.bind_host or ("127.0.0.1" if loopback else "0.0.0.0")
    advertise = s.advertise_host or ("127.0.0.1" if loopback else route_host(target_host))
    # Before the loop thread allocates anything: it is to share one arena.
    tune_for(s)
    loop, thread = _start_loop(s.reduce_threads)
    return bind, advertise, loop, thread


def start_backend(
    s: Settings,
    rendezvous: Rendezvous,
    target_host: str,
    rank: int | None = None,
    world_size: int | None = None,
) -> Backend:
    """Start the loop thread and a peer joining through ``rendezvous``
    (bound and advertised as ``target_host``, the master's or the
    coordinator's host, calls for); return the Backend once the group formed.
    Releases everything if it does not."""
    connect = s.timeouts.connect
    bind, advertise, loop, thread = prepare(s, target_host)
    start = Peer.start(
        rank,
        world_size,
        rendezvous=rendezvous,
        bind_host=bind,
        port=s.port,
        advertise_host=advertise,
        settings=s,
    )
    starting = asyncio.run_coroutine_threadsafe(start, loop)
    try:
        peer = starting.result(timeout=connect + 30)
    except BaseException as exc:
        # Cancelling the start closes whatever it had bound (Peer.start cleans
        # up on any exception, cancellation included).
        starting.cancel()
        with contextlib.suppress(BaseException):
            starting.result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not loop.is_running() and not loop.is_closed():
            # Shuts down the loop's default executor, whose thread ran the
            # rendezvous: left open, it would outlive the failed call.
            loop.close()
        if isinstance(exc, TimeoutError) and not isinstance(exc, FerroGrpcError):
            raise RendezvousError(f"the group did not form within {connect + 30:g}s") from exc
        raise
    return Backend(peer, loop, thread)


# The Backend's calls that run in its group (an elastic backend forwards
# them to its current epoch's Backend).
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_reduce_coalesced",
        "broadcast",
        "barrier",
        "all_to_all_single",
        "send",
        "recv",
        "recv_any",
        "submit",
    }
)
