"""ferrogrpc as a torch.distributed backend: ``dist.init_process_group("ferrogrpc")``.

Importing ferrogrpc registers the backend for CPU and CUDA tensors (see
[Note: import without torch] in registration.py). Each process group (the
default one, and every ``dist.new_group(..., backend="ferrogrpc")``) is an
adapter over its own :class:`Backend`: the same engine, rendezvoused
through the store torch hands the backend, so env://, ``tcp://``,
``file://`` and ``store=`` all work as they do for gloo.

Options (``pg_options``): a mapping (or an object whose public attributes
are) of :func:`~ferrogrpc.init_backend` keyword arguments, laid over the
environment (``FERROGRPC_*``), e.g.
``pg_options={"token": "...", "shm": False}``:

    timeouts, chunk_policy, checksum, tls, token, shm, bind_host,
    advertise_host, port

Any other key is a ConfigError when the group is created.

Synchronizes: every operation of torch's that is a collective is one here
too (all ranks, same order); ``send``/``recv`` are between two ranks. Every
operation returns a torch ``Work`` over a future (``wait()``,
``get_future()``); errors are ferrogrpc's (naming the rank, the peer and
the op), raised when torch waits, and on failure the group is broken as a
Backend is. Operations torch has and the engine does not are composed from
those it does: ``reduce`` is an all_reduce (every rank gets the result),
``gather`` an all_gather, ``scatter`` a broadcast of the root's tensors,
``alltoall`` an all_to_all of the flattened tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import os
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work as _TorchWork

from ..control.rendezvous import Activity, RendezvousResult, exchange_through_store, table_result
from ..env import MASTER_ADDR_ENV, Settings
from ..errors import CollectiveTimeoutError, ConfigError, FerroGrpcError, RendezvousError
from ..runtime.backend import Backend, start_backend
from ..runtime.call import Call
from ..runtime.work import Work

NAME = "ferrogrpc"
# monitored_barrier's point-to-point tag (users' tags are best kept below it).
MONITOR_TAG = 0xFE57B000

T = TypeVar("T")
_Make = Callable[[], Coroutine[Any, Any, Any]]  # a Peer's call, made when the op is issued
_INIT_KEYS = {
    "timeouts",
    "chunk_policy",
    "checksum",
    "tls",
    "token",
    "shm",
    "bind_host",
    "advertise_host",
    "port",
}


class TorchStoreRendezvous:
    """The rendezvous through the (prefixed, per-group) store torch gives a
    backend: each rank sets its entry and waits for the others'."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    def _exchange(self, address: str, nonce: str, host: str) -> list[dict[str, str]]:
        entry = {"address": address, "nonce": nonce, "host": host}
        try:
            # Keys per round: a group destroyed and created again on the same
            # store (the same prefix) must not read the last round's table.
            # Every rank takes a ticket; the world_size tickets of one round
            # are all taken before any rank of it returns (each waits for
            # all), so rank order does not matter.
            ticket = int(self.store.add("ferrogrpc/tickets", 1))
            round_ = (ticket - 1) // self.world_size
            # torch owns this store (and keeps it for the group's life): no
            # read handshake, which only decides when a store we host may stop.
            return exchange_through_store(
                self.store,
                f"ferrogrpc/{round_}/",
                self.rank,
                self.world_size,
                entry,
                self.timeout,
                hosted_here=False,
            )
        except (RuntimeError, OSError) as exc:
            raise RendezvousError(
                f"not every rank published its address within {self.timeout:g}s: {exc}",
                rank=self.rank,
                world_size=self.world_size,
            ) from exc

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str, host: str = ""
    ) -> RendezvousResult:
        loop = asyncio.get_running_loop()
        table = await loop.run_in_executor(None, self._exchange, address, nonce, host)
        return table_result(self.rank, self.world_size, table)

    def start_heartbeats(self, activity: Activity) -> None:
        """Nothing: a store keeps no member table."""

    async def close(self) -> None:
        self.store = None


def _store_host(store: Any) -> str:
    """The host the store's server is on, where torch says (a TCPStore);
    else MASTER_ADDR, else loopback (a FileStore or HashStore on one host)."""
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host = getattr(base, "host", None)
    if isinstance(host, str) and host:
        return host
    return os.environ.get(MASTER_ADDR_ENV) or "127.0.0.1"


def _options(given: object) -> dict[str, Any]:
    if given is None:
        return {}
    items = given.items() if isinstance(given, Mapping) else vars(given).items()
    options = {k: v for k, v in items if not k.startswith("_")}
    unknown = set(options) - _INIT_KEYS
    if unknown:
        raise ConfigError(
            f"pg_options for the ferrogrpc backend take {sorted(_INIT_KEYS)}; "
            f"unknown: {sorted(unknown)}"
        )
    return options


class FerroWork(_TorchWork):
    """A torch ``Work`` over a ferrogrpc :class:`Work`: ``wait()`` raises
    the collective's error (ferrogrpc's, naming the rank), ``get_future()``
    gives a future completed with the result."""

    def __init__(self, work: Work[Any]) -> None:
        super().__init__()
        self._work = work
        self._future = work.get_future()

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
        self._work.wait(seconds or None)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_completed() and self._work.exception() is None

    def exception(self) -> Any:
        return self._work.exception()

    def get_future(self) -> Any:
        return self._future

    def synchronize(self) -> None:
        self._work.wait()


class _SourceWork(FerroWork):
    """A receive from any source: its Work's result is the sender's rank,
    and its future's the received tensors, as torch expects."""

    def __init__(self, work: Work[int], tensors: Sequence[torch.Tensor]) -> None:
        super().__init__(work)
        self._tensors = list(tensors)
        self._future = self._future.then(lambda _: self._tensors)

    def _source_rank(self) -> int:
        return int(self._work.wait())

    source_rank = _source_rank


class FerroProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose operations run on a ferrogrpc Backend."""

    def __init__(self, backend: Backend, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.backend = backend
        self._name = ""

    # ---------------------------------------------------------- identity

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def _set_group_name(self, name: str) -> None:
        self._name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._name

    def shutdown(self) -> None:
        self.backend.close()

    def abort(self) -> None:
        self.backend.close()

    def __repr__(self) -> str:
        return f"<FerroProcessGroup rank {self.rank()}/{self.size()} {self.backend!r}>"

    # ------------------------------------------------------------ works

    def _run(self, name: str, make: _Make) -> Any:
        """``make()`` run on the backend's loop (see :meth:`_issue`)."""
        coro = self._issue(name, make)
        if isinstance(coro, FerroWork):
            return coro
        work = self.backend.submit(coro, name, True)
        assert isinstance(work, Work)
        return FerroWork(work)

    def _issue(self, name: str, make: _Make) -> Coroutine[Any, Any, Any] | FerroWork:
        """``make()``, the Peer's call (its argument checks, and the op's
        number, in the caller's order). On a broken group it raises at once:
        torch gets a failed Work instead, raised by ``wait()`` as gloo's is,
        not by the call. Argument errors still raise here."""
        try:
            return make()
        except FerroGrpcError as exc:
            if self.backend.peer._life.broken is None:
                raise
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_exception(exc)
            return FerroWork(Work(future, name))

    def _now_or_run(self, name: str, make: _Make, value: Any) -> Any:
        """A small collective on one host whose turn it is runs now, in this
        thread (direct.py), and torch gets a completed Work (its error, if
        any, raised by ``wait()``); any other runs on the backend's loop.
        ``make`` is the Peer's call (see :meth:`_issue`)."""
        coro = self._issue(name, make)
        if isinstance(coro, FerroWork):
            return coro
        if isinstance(coro, Call):
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            try:
                done, _ = coro.run_here()
            except FerroGrpcError as exc:
                future.set_exception(exc)
                return FerroWork(Work(future, name))
            if done:
                future.set_result(value)
                return FerroWork(Work(future, name))
        return self._run(name, lambda: _returning(coro, value))

    # ----------------------------------------------------------- checks

    @contextlib.contextmanager
    def _refusable(self, name: str, count: int = 1) -> Iterator[None]:
        """Run this op's own argument checks (the list and shape rules torch's
        list forms add to the engine's) as a collective's are: a failure
        takes the ``count`` sequence numbers its collectives would have, and
        every rank fails them at once naming this rank (refusal.py); the
        error raises here, before anything is issued."""
        with self.backend.peer._checks(name, lambda: count):
            yield

    def _bad(self, name: str, message: str) -> ConfigError:
        return ConfigError(
            message, rank=self.backend.rank, world_size=self.backend.world_size, op=name
        )

    def _list(self, name: str, what: str, items: Sequence[Any], length: int) -> None:
        if len(items) != length:
            raise self._bad(name, f"{what} has {len(items)} entries; expected {length}")

    def _like(self, name: str, what: str, t: Any, ref: torch.Tensor) -> None:
        """``t`` must be a tensor of ``ref``'s shape and dtype, as gloo
        requires of every output and input of a list form."""
        if not isinstance(t, torch.Tensor):
            raise self._bad(name, f"{what} is a {type(t).__name__}, not a tensor")
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise self._bad(
                name,
                f"{what} is {tuple(t.shape)} {t.dtype}; it must match the input's "
                f"{tuple(ref.shape)} {ref.dtype}",
            )

    # ------------------------------------------------------- collectives

    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else "sum"
        peer = self.backend.peer
        if len(tensors) == 1:
            return self._now_or_run("all_reduce", lambda: peer.all_reduce(tensors[0], op), tensors)
        return self._run(
            "all_reduce", lambda: _returning(peer.all_reduce_coalesced(tensors, op), tensors)
        )

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else "sum"
        peer = self.backend.peer
        return self._run(
            "all_reduce_coalesced",
            lambda: _returning(peer.all_reduce_coalesced(tensors, op), tensors),
        )

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
        root = opts.rootRank
        peer = self.backend.peer

        async def run() -> list[torch.Tensor]:
            for t in tensors:
                await peer.broadcast(t, root)
            return list(tensors)

        return self._run("broadcast", run)

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
        # Every rank gets the result; torch leaves non-root tensors unspecified.
        peer = self.backend.peer

        async def run() -> list[torch.Tensor]:
            for t in tensors:
                await peer.all_reduce(t, opts.reduceOp)
            return list(tensors)

        return self._run("reduce", run)

    def allgather(
        self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any
    ) -> Any:
        peer, name, world = self.backend.peer, "all_gather", self.size()
        with self._refusable(name, len(inputs)):
            self._list(name, "output_tensors", outputs, len(inputs))
            for i, (out, t) in enumerate(zip(outputs, inputs, strict=True)):
                self._list(name, f"output_tensors[{i}]", out, world)
                for r, o in enumerate(out):
                    self._like(name, f"output_tensors[{i}][{r}]", o, t)

        async def run() -> Any:
            for out, t in zip(outputs, inputs, strict=True):
                parts = await peer.all_gather(t)
                for o, p in zip(out, parts, strict=True):
                    o.copy_(p)
            return outputs

        return self._run("all_gather", run)

    def allgather_coalesced(
        self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any
    ) -> Any:
        # outputs[r][i] receives rank r's inputs[i].
        peer, name = self.backend.peer, "all_gather_coalesced"
        with self._refusable(name, len(inputs)):
            self._list(name, "output_lists", outputs, self.size())
            for r, out in enumerate(outputs):
                self._list(name, f"output_lists[{r}]", out, len(inputs))
                for i, t in enumerate(inputs):
                    self._like(name, f"output_lists[{r}][{i}]", out[i], t)

        async def run() -> Any:
            for i, t in enumerate(inputs):
                parts = await peer.all_gather(t)
                for r, p in enumerate(parts):
                    outputs[r][i].copy_(p)
            return outputs

        return self._run("all_gather_coalesced", run)

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        peer = self.backend.peer
        return self._now_or_run(
            "all_gather_into_tensor", lambda: peer.all_gather_into_tensor(out, inp), out
        )

    all_gather_single = _allgather_base

    def all_gather_single_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> Any:
        peer, name = self.backend.peer, "all_gather_into_tensor"
        with self._refusable(name, len(inputs)):
            self._list(name, "outputs", outputs, len(inputs))

        async def run() -> Any:
            for out, t in zip(outputs, inputs, strict=True):
                await peer.all_gather_into_tensor(out, t)
            return outputs

        return self._run("all_gather_into_tensor", run)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], opts: Any
    ) -> Any:
        peer, name, world = self.backend.peer, "reduce_scatter", self.size()
        with self._refusable(name, len(outputs)):
            self._list(name, "input_lists", inputs, len(outputs))
            for i, (out, parts) in enumerate(zip(outputs, inputs, strict=True)):
                self._list(name, f"input_lists[{i}]", parts, world)
                for r, part in enumerate(parts):
                    self._like(name, f"input_lists[{i}][{r}]", part, out)

        async def run() -> Any:
            for out, parts in zip(outputs, inputs, strict=True):
                flat = torch.cat([p.reshape(-1) for p in parts])
                await peer.reduce_scatter_tensor(out, flat.view(-1), opts.reduceOp)
            return outputs

        return self._run("reduce_scatter", run)

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
        peer = self.backend.peer
        return self._now_or_run(
            "reduce_scatter_tensor",
            lambda: peer.reduce_scatter_tensor(out, inp, opts.reduceOp),
            out,
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any
    ) -> Any:
        peer, name = self.backend.peer, "reduce_scatter_tensor"
        with self._refusable(name, len(inputs)):
            self._list(name, "outputs", outputs, len(inputs))

        async def run() -> Any:
            for out, t in zip(outputs, inputs, strict=True):
                await peer.reduce_scatter_tensor(out, t, opts.reduceOp)
            return outputs

        return self._run("reduce_scatter_tensor", run)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def gather(
        self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any
    ) -> Any:
        root, me, peer, name = opts.rootRank, self.rank(), self.backend.peer, "gather"
        with self._refusable(name):
            self._list(name, "input_tensors", inputs, 1)
            if me == root:
                self._list(name, "output_tensors", outputs, 1)
                self._list(name, "output_tensors[0]", outputs[0], self.size())
                for r, o in enumerate(outputs[0]):
                    self._like(name, f"output_tensors[0][{r}]", o, inputs[0])
            elif outputs and any(len(o) for o in outputs):
                raise self._bad(name, f"only the root (rank {root}) may pass output tensors")

        async def run() -> Any:
            parts = await peer.all_gather(inputs[0])
            if me == root:
                for o, p in zip(outputs[0], parts, strict=True):
                    o.copy_(p)
            return outputs

        return self._run("gather", run)

    def scatter(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], opts: Any
    ) -> Any:
        root, me, world, peer = opts.rootRank, self.rank(), self.size(), self.backend.peer
        name = "scatter"
        with self._refusable(name):
            self._list(name, "output_tensors", outputs, 1)
            if me == root:
                self._list(name, "input_tensors", inputs, 1)
                self._list(name, "input_tensors[0]", inputs[0], world)
                for r, t in enumerate(inputs[0]):
                    self._like(name, f"input_tensors[0][{r}]", t, outputs[0])
            elif inputs and any(len(i) for i in inputs):
                raise self._bad(name, f"only the root (rank {root}) may pass input tensors")
        out = outputs[0]

        async def run() -> Any:
            if me == root:
                buf = torch.stack([t.reshape(out.shape) for t in inputs[0]])
            else:
                buf = torch.empty((world, *out.shape), dtype=out.dtype, device=out.device)
            await peer.broadcast(buf, root)
            out.copy_(buf[me])
            return outputs

        return self._run("scatter", run)

    def alltoall(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> Any:
        peer, name, world = self.backend.peer, "all_to_all", self.size()
        with self._refusable(name):
            self._list(name, "output_tensors", outputs, world)
            self._list(name, "input_tensors", inputs, world)
            for r, (o, t) in enumerate(zip(outputs, inputs, strict=True)):
                if not isinstance(o, torch.Tensor) or not isinstance(t, torch.Tensor):
                    raise self._bad(name, f"entry {r} is not a tensor")
                if o.dtype != inputs[0].dtype or t.dtype != inputs[0].dtype:
                    raise self._bad(name, f"entry {r}'s dtype differs from the others'")

        async def run() -> Any:
            flat_in = torch.cat([t.reshape(-1) for t in inputs])
            flat_out = torch.empty(
                sum(t.numel() for t in outputs), dtype=outputs[0].dtype, device=outputs[0].device
            )
            await peer.all_to_all_single(
                flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs]
            )
            at = 0
            for t in outputs:
                t.copy_(flat_out[at : at + t.numel()].view(t.shape))
                at += t.numel()
            return outputs

        return self._run("all_to_all", run)

    def alltoall_base(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        opts: Any = None,
    ) -> Any:
        peer = self.backend.peer
        return self._run(
            "all_to_all",
            lambda: peer.all_to_all_single(
                out, inp, list(out_splits) or None, list(in_splits) or None
            ),
        )

    all_to_all_single = alltoall_base

    def barrier(self, opts: Any = None) -> Any:
        return self._now_or_run("barrier", self.backend.peer.barrier, None)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: every other rank reports to rank 0 and
        waits for its answer, on point-to-point messages with a tag of their
        own. Rank 0 raises CollectiveTimeoutError naming the first rank (with
        ``wait_all_ranks``: every rank) that did not report within
        ``timeout`` (default: the collective timeout); another rank raises it
        naming rank 0 when no answer comes in time. After it raised, a late
        rank's report is still taken by the barrier that gave up on it: as
        with gloo, the group should be torn down."""
        seconds = (
            timeout.total_seconds()
            if isinstance(timeout, datetime.timedelta)
            else self.backend.peer._ctx.timeouts.collective
        )
        backend, me = self.backend, self.backend.peer._me
        deadline = time.monotonic() + seconds
        token = torch.zeros(1, dtype=torch.uint8)
        if backend.rank != 0:
            sent = backend.send(token, 0, MONITOR_TAG, async_op=True)
            answer = backend.recv(torch.zeros(1, dtype=torch.uint8), 0, MONITOR_TAG, async_op=True)
            assert isinstance(sent, Work) and isinstance(answer, Work)
            try:
                sent.wait(max(0.0, deadline - time.monotonic()))
                answer.wait(max(0.0, deadline - time.monotonic()))
            except CollectiveTimeoutError:
                raise me.error(
                    CollectiveTimeoutError,
                    f"rank 0 did not answer monitored_barrier within {seconds:g}s (it waits "
                    "for every rank's report: another rank is late, or rank 0 is)",
                    op="monitored_barrier",
                    peer=0,
                ) from None
            return
        reports = {
            r: backend.recv(torch.zeros(1, dtype=torch.uint8), r, MONITOR_TAG, async_op=True)
            for r in range(1, backend.world_size)
        }
        missing: list[int] = []
        for r, work in reports.items():
            assert isinstance(work, Work)
            try:
                work.wait(max(0.0, deadline - time.monotonic()))
            except CollectiveTimeoutError:
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            which = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
            raise me.error(
                CollectiveTimeoutError,
                f"{which} did not reach monitored_barrier within {seconds:g}s",
                op="monitored_barrier",
                peer=missing[0],
            )
        for r in reports:
            answered = backend.send(token, r, MONITOR_TAG, async_op=True)
            assert isinstance(answered, Work)
            answered.wait(max(0.0, deadline - time.monotonic()) or None)

    # ---------------------------------------------------- point to point

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> Any:
        peer = self.backend.peer
        return self._run("send", lambda: peer.send(tensors[0], dst, tag))

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int = 0) -> Any:
        peer = self.backend.peer
        return self._run("recv", lambda: peer.recv(tensors[0], src, tag))

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int = 0) -> Any:
        """``dist.recv(t)`` with no ``src``: the next message with ``tag``
        from any rank; the Work's ``_source_rank()`` names the sender, as
        gloo's does."""
        peer = self.backend.peer
        sender = self._issue("recv", lambda: peer.recv_any(tensors[0], tag))
        if isinstance(sender, FerroWork):
            return sender
        work = self.backend.submit(sender, "recv", True)
        assert isinstance(work, Work)
        return _SourceWork(work, tensors)


async def _returning(coro: Coroutine[Any, Any, Any], value: T) -> T:
    await coro
    return value


def create(dist_opts: Any, pg_options: Any) -> FerroProcessGroup:
    """torch's backend hook (registration.py): one ferrogrpc Backend per
    process group.

    Args:
        dist_opts: torch's options: the group's store, rank and size.
        pg_options: ``init_backend`` keyword arguments (see the module
            docstring), or None.

    Returns:
        The process group, once every rank of it has joined.

    Raises:
        ConfigError: an unknown or bad option, or an elastic group
            (``FERROGRPC_ELASTIC``), which torch's process groups do not
            support.
        RendezvousError, CollectiveTimeoutError: as ``init_backend``.
    """
    store, rank, world = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    s = Settings.from_env().merged(**_options(pg_options))
    if s.elastic:
        raise ConfigError(
            "the torch.distributed backend does not support elastic groups "
            "(FERROGRPC_ELASTIC is set): a torch process group has a fixed world size. "
            "Elastic training is supported with fg.init_backend(elastic=True) and fg.DDP, "
            "with fg.ElasticState for joiners. Under torchrun, launch with "
            "--rdzv-backend=ferrogrpc --rdzv-endpoint=HOST:PORT (a `ferrogrpc coordinator`; "
            "docs/launchers.md): a failure restarts only its own node's workers and new "
            "nodes join live; elsewhere pass coordinator='HOST:PORT'",
            rank=rank,
            world_size=world,
        )
    if s.malloc_tuning is None:
        # Process-wide, so not behind the user's back inside their own
        # training loop: FERROGRPC_MALLOC_TUNING=1 opts in.
        s = dataclasses.replace(s, malloc_tuning=False)
    rendezvous = TorchStoreRendezvous(store, rank, world, s.timeouts.connect)
    backend = start_backend(s, rendezvous, _store_host(store), rank, world)
    return FerroProcessGroup(backend, rank, world)


def monitored_barrier(
    torch_barrier: Callable[..., None],
    group: Any = None,
    timeout: datetime.timedelta | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """``torch.distributed.monitored_barrier``, which torch implements for
    gloo only (it refuses every other backend by name), extended to
    ferrogrpc's groups: a barrier that raises CollectiveTimeoutError (naming
    the rank waited for) if it does not complete within ``timeout``. Other
    backends go to torch's own, ``torch_barrier`` (registration.py puts
    this one in its place)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(pg, FerroProcessGroup):
        pg.monitored_barrier(timeout, wait_all_ranks)
        return
    torch_barrier(group, timeout, wait_all_ranks)
