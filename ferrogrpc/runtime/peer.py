"""The asyncio peer: one per rank. It joins the group, then runs collectives.

:meth:`Peer.start` joins the group (join.py: the transport and the
stream intake, the rendezvous, the job table, the failure policy, the
same-host plane) and composes the peer from those parts and the few it
adds: the engine that numbers and runs every collective (engine.py), the
placement of tensors on host buffers (placement.py), point-to-point
messages (p2p.py) and the argument checks' refusals (refusal.py); then it
checks that every rank reaches every other (ring_check.py). Each
collective here checks its arguments (validate.py), places its tensors,
takes a sequence number, and returns a :class:`~ferrogrpc.runtime.call.Call`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Self, TypeVar

import torch

from ..algorithms import schedule
from ..algorithms.blocks import Format
from ..algorithms.jobs import Job
from ..algorithms.p2p import PointToPoint
from ..algorithms.quantized import FORMATS, ErrorFeedback, all_reduce_quantized
from ..algorithms.staging import Stage
from ..control.rendezvous import Rendezvous
from ..env import Settings
from ..errors import ConfigError, FerroGrpcError, Identity, PeerError
from ..observe import setup as observe_setup
from ..observe.observer import Observer
from ..ops import DTYPE_TO_WIRE, ReduceOp
from ..options import ChunkPolicy, Timeouts, TLSConfig
from ..transport.integrity import Checksum
from ..transport.streams import Transport
from ..v1 import collective_pb2 as pb
from . import validate
from .call import Call
from .direct_mesh import TcpMesh
from .engine import Engine
from .join import Ahead, Parts, join
from .placement import Placed, Placement
from .refusal import CallChecks, group_count
from .ring_check import check_ring

T = TypeVar("T")

# How long close() waits for abort notices still being delivered.
ABORT_DELIVERY_S = 2.0
# A point-to-point message is bytes nothing reduces: any dtype the wire names.
P2P_DTYPES = tuple(DTYPE_TO_WIRE)


class Peer:
    """One rank of a ferrogrpc group, on an asyncio event loop.

    Create it with :meth:`Peer.start`, which binds the transport, exchanges
    addresses through a rendezvous and checks the ring with a barrier.

    Every collective is a synchronization point: all ranks must call the same
    collectives in the same order with matching kinds, dtypes, sizes, ops and
    roots. A mismatch is a :class:`ProtocolError` on every rank; it never
    hangs. Several collectives may be in flight at once; each gets the next
    sequence number *when it is called* (not when it is awaited), and chunks
    are routed by that tag.

    On failure (a peer dies, stalls past the idle timeout, disagrees, or sends
    corrupt data) the collective raises on this rank, every other rank is
    told, and the peer is *broken*: every later collective raises at once with
    the original cause. ``close()`` still works.
    """

    def __init__(self, parts: Parts, placement: Placement, chunk_policy: ChunkPolicy) -> None:
        """Use :meth:`start`."""
        self._parts = parts
        self._ctx = parts.ctx
        self._me = parts.ctx.identity
        self._jobs = parts.jobs
        self._life = parts.life
        self._plane = parts.plane
        self._engine = Engine(
            parts.ctx,
            parts.jobs,
            parts.life,
            chunk_policy,
            parts.topology,
            parts.plane,
            parts.observer,
        )
        self._placement = placement
        self._p2p = PointToPoint(parts.ctx, self._engine.links, self._engine.chunk_bytes)
        # Argument checks; a refused call still takes its seq (refusal.py).
        self._checks = CallChecks(
            parts.jobs, parts.ctx.failure, parts.life, self._engine.refused
        ).run
        self._mesh: TcpMesh | None = None

    @property
    def rank(self) -> int:
        """This peer's rank, 0 to ``world_size - 1``."""
        return self._me.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self._me.world_size

    @property
    def address(self) -> str:
        """The address this rank advertises to the others."""
        return self._parts.address

    def _set_stamp(self, stamp: int) -> None:
        """Stamp the collectives called from now on (Engine.stamp)."""
        self._engine.stamp = stamp

    @property
    def data_path(self) -> str:
        """How this rank's tensor bytes travel: ``"shared memory"`` (every
        rank on this host), ``"two-level"`` (shared memory inside hosts, gRPC
        across), or ``"grpc"``."""
        return self._engine.data_path

    def _call(self, placed: Placed, result: Callable[[], T]) -> Call[T]:
        return Call(self._engine, placed, result)

    async def close(self, *, notice_grace: float = ABORT_DELIVERY_S) -> None:
        """Stop serving and close every connection. Idempotent. Running
        collectives fail with PeerError. Failure notices still on their way
        to other ranks, and the last end markers of this rank's ring
        collectives, get up to ``notice_grace`` seconds to land (a rank that
        is stopped never takes them)."""
        if self._life.begin_close():
            await self._shutdown(notice_grace)

    async def _shutdown(self, notice_grace: float = ABORT_DELIVERY_S) -> None:
        """Release everything; the lifecycle is CLOSING (see [Note: peer
        lifecycle]) and ends CLOSED."""
        me = self._me
        closed = "the peer was closed while this collective ran"
        self._jobs.cancel_all(lambda j: me.error(PeerError, closed, op=j.name, seq=j.seq))
        # Failure notices, and the last end markers of ring streams ending in
        # the background (a right neighbour may still be reading them).
        await asyncio.gather(
            self._ctx.failure.drain(notice_grace), self._ctx.transport.settle(notice_grace)
        )
        await self._engine.links.close()
        self._engine.close()
        if self._mesh is not None:
            self._mesh.close()
        await self._parts.close()  # closes the observer too

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @classmethod
    async def start(
        cls,
        rank: int | None,
        world_size: int | None,
        *,
        rendezvous: Rendezvous | None = None,
        transport: Transport | None = None,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        timeouts: Timeouts | None = None,
        chunk_policy: ChunkPolicy | None = None,
        checksum: Checksum | bool | str | None = None,
        tls: TLSConfig | None = None,
        token: str | None = None,
        shm: bool | None = None,
        direct: bool | None = None,
        placement: Callable[[Identity], Placement] | None = None,
        settings: Settings | None = None,
        ahead: Ahead | None = None,
    ) -> Peer:
        """Bind, join the rendezvous, connect, and return once every rank has.

        ``rank`` and ``world_size`` may be None when the rendezvous assigns
        them (the coordinator does). Without a ``rendezvous`` the env://
        TCPStore rendezvous at MASTER_ADDR:MASTER_PORT is used. Options left
        None take the same defaults as :func:`ferrogrpc.init_backend`: the
        environment's (``FERROGRPC_TIMEOUT``, ``FERROGRPC_CHECKSUM``, ...),
        else the built-in ones. ``tls`` (mutual TLS) and ``token``
        (shared-token authentication) secure the default gRPC transport.
        ``checksum`` (default CRC-32; ``"crc32c"``, False, or a function of
        the payload bytes) guards every chunk that crosses gRPC; all ranks
        must agree. ``shm`` (default on; ``FERROGRPC_SHM=0`` turns it off)
        lets ranks that share a host and a network namespace exchange tensor
        bytes through shared memory (samehost/plane.py). ``direct`` (default
        on; ``FERROGRPC_DIRECT=0`` turns it off) runs small collectives
        between ranks that share no memory on the TCP mesh (direct_mesh.py).
        ``placement`` builds how device tensors are staged (tests).
        ``ahead`` holds what an elastic backend made ahead for this epoch
        (join.py's Ahead: a shared segment, channels to joiners).

        Raises RendezvousError, or CollectiveTimeoutError if the ring does
        not form within the connect timeout; whatever was bound is released.
        """
        s = (settings or Settings.from_env()).merged(
            timeouts=timeouts,
            chunk_policy=chunk_policy,
            checksum=checksum,
            tls=tls,
            token=token,
            shm=shm,
            direct=direct,
            # What the rank binds, resolved: its metrics server binds the same
            # host (SECURITY.md "What listens, and where").
            bind_host=bind_host,
        )
        observe_setup.check(s)  # before anything is bound or joined
        parts = await join(
            s, rank, world_size, rendezvous, transport, bind_host, port, advertise_host, ahead
        )
        try:
            me = parts.ctx.identity
            peer = cls(
                parts, placement(me) if placement is not None else Placement(me), s.chunk_policy
            )
            parts.open()
            peer._mesh = await check_ring(
                peer,
                peer._engine,
                parts.ctx,
                parts.observer,
                s,
                credentials=parts.credentials,
                shares_memory=parts.topology.shares_memory,
                bind_host=bind_host,
            )
        except BaseException:
            await parts.close()
            raise
        parts.rendezvous.start_heartbeats(parts.jobs.current)
        return peer

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        wire_dtype: torch.dtype | None = None,
        feedback: ErrorFeedback | None = None,
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Reduce ``tensor`` across all ranks, in place; returns ``tensor``.

        Small tensors (up to 256 KiB) go in one exchange; ranks on one host
        reduce through shared memory; otherwise ring reduce-scatter then
        ring all-gather over gRPC, each rank sending and receiving 2(n-1)/n
        of the tensor. Every rank ends with bitwise identical values.

        ``wire_dtype`` (``torch.bfloat16`` or ``torch.float16``, for float32
        and float64 tensors) sends the bytes that cross gRPC in that dtype,
        while every hop accumulates in the tensor's own dtype; the result is
        the same on every rank, within the README's error bound (a ring
        rounds it to the wire dtype). Synchronization point. On failure the tensor's contents are
        unspecified (partly reduced): keep a copy if you need to retry.

        ``wire_dtype=torch.int8`` (float32 and float64 tensors, sum or mean
        only: a rounded max or product is not the inputs' own): every rank
        rounds its tensor to blockwise-scaled int8 once, each shard's owner
        adds the ranks' values in the tensor's dtype and rounds that once,
        and an all-gather gives every rank bitwise identical values, on every
        path; about a quarter of float32's bytes. The bound is in [Note:
        int8 all-reduce] (algorithms/quantized.py). ``feedback`` (int8, int4)
        carries the rounding errors into the next call on the same tensor,
        as DDP's ``compression="int8"`` does. On failure the tensor is
        unchanged. ``wire_dtype=torch.int4``: the same with values in -7..7,
        two to a byte (half of int8's bytes, 18 times its bound; DiLoCo's
        ``compression="int4"``).
        """
        fmt = FORMATS.get(wire_dtype) if isinstance(wire_dtype, torch.dtype) else None
        if fmt is not None:
            return self._all_reduce_quantized(tensor, op, feedback, fmt)
        if feedback is not None:
            raise self._me.error(
                ConfigError,
                "feedback carries int8 or int4 rounding errors: pass wire_dtype=torch.int8 "
                "(or torch.int4) with it",
                op="all_reduce",
            )
        with self._checks("all_reduce"):
            validate.tensor(self._me, tensor, "all_reduce")
            validate.writable(self._me, tensor, "all_reduce")
            rop = validate.reduce_op(self._me, op, tensor, "all_reduce")
            wire = validate.wire_dtype(self._me, wire_dtype, tensor, "all_reduce")
        self._engine.check_open()
        placed = self._placement.in_place(
            tensor,
            lambda flat: self._engine.number(pb.ALL_REDUCE, "all_reduce", flat, rop, wire=wire),
        )
        return self._call(placed, lambda: tensor)

    def _all_reduce_quantized(
        self, tensor: torch.Tensor, op: ReduceOp | str, feedback: ErrorFeedback | None, fmt: Format
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """:meth:`all_reduce` with ``wire_dtype=torch.int8`` (or int4): two
        collectives (an all-to-all and an all-gather) on every path; on
        failure the tensor is unchanged."""
        me, name = self._me, "all_reduce"
        with self._checks(name, lambda: 2):
            validate.tensor(me, tensor, name)
            validate.writable(me, tensor, name)
            rop = validate.reduce_op(me, op, tensor, name)
            if tensor.dtype not in (torch.float32, torch.float64):
                raise me.error(
                    ConfigError,
                    f"wire_dtype=torch.{fmt.name} narrows float32 and float64 tensors; this one is "
                    f"{tensor.dtype}",
                    op=name,
                )
            if rop not in (ReduceOp.SUM, ReduceOp.MEAN):
                raise me.error(
                    ConfigError,
                    f"wire_dtype=torch.{fmt.name} reduces with sum or mean only, not "
                    f"{rop.name.lower()}: "
                    "a rounded max or product is not the max or product of the inputs",
                    op=name,
                )
        self._engine.check_open()
        if me.world_size == 1:

            async def alone() -> torch.Tensor:
                return tensor

            return alone()
        return all_reduce_quantized(self, tensor, rop, feedback, fmt)

    def all_reduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        wire_dtype: torch.dtype | None = None,
    ) -> Coroutine[Any, Any, list[torch.Tensor]]:
        """All-reduce several tensors as one collective per dtype and device
        (in a fixed order): each group is copied into one flat buffer,
        reduced, and copied back, in place. Returns the tensors. Every rank
        must pass the same shapes and dtypes, in the same order.
        Synchronization point (one per group)."""
        # All checked before any group takes a seq; a refusal takes one per group.
        with self._checks("all_reduce_coalesced", lambda: group_count(tensors)):
            groups = validate.coalesced(self._me, tensors, op, wire_dtype, "all_reduce_coalesced")
        runs = []
        for key in sorted(groups):
            members = [tensors[i] for i in groups[key]]
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            runs.append((members, flat, self.all_reduce(flat, op, wire_dtype=wire_dtype)))

        async def run() -> list[torch.Tensor]:
            failed: list[FerroGrpcError] = []
            for members, flat, coro in runs:
                try:
                    await coro  # each group runs, or fails at once: none stays taken
                except FerroGrpcError as exc:
                    failed.append(exc)
                    continue
                offset = 0
                with torch.no_grad():
                    for t in members:
                        n = t.numel()
                        t.copy_(flat[offset : offset + n].view(t.shape))
                        offset += n
            if failed:
                raise failed[0]
            return list(tensors)

        return run()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Call[torch.Tensor]:
        """Copy ``root``'s tensor into every rank's ``tensor``, in place.

        A pipelined chain in ring order from the root: each rank forwards a
        chunk as soon as it has it. Synchronization point. On failure the
        tensor's contents are unspecified on non-root ranks.
        """
        with self._checks("broadcast"):
            validate.tensor(self._me, tensor, "broadcast")
            validate.writable(self._me, tensor, "broadcast")
            validate.root(self._me, root, "broadcast")
        self._engine.check_open()
        placed = self._placement.in_place(
            tensor,
            lambda flat: self._engine.number(pb.BROADCAST, "broadcast", flat, root=root),
            load=self.rank == root,
            store=self.rank != root,
        )
        return self._call(placed, lambda: tensor)

    def all_gather(
        self, tensor: torch.Tensor, *, wire_dtype: torch.dtype | None = None
    ) -> Call[list[torch.Tensor]]:
        """Gather every rank's ``tensor``; returns one tensor per rank, in rank
        order, each shaped like ``tensor``. Ring all-gather (one exchange
        when small; through shared memory on one host). Synchronization
        point. ``wire_dtype``: see :meth:`all_gather_into_tensor`."""
        with self._checks("all_gather"):
            validate.tensor(self._me, tensor, "all_gather")
        self._engine.check_open()
        out = torch.empty(
            (self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        gathered = self.all_gather_into_tensor(out, tensor, wire_dtype=wire_dtype)
        return gathered.returning(lambda: list(out.unbind(0)))

    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor, *, wire_dtype: torch.dtype | None = None
    ) -> Call[torch.Tensor]:
        """Gather every rank's ``tensor`` into ``out`` (rank-major);
        ``out.numel()`` must be ``world_size * tensor.numel()``. Returns
        ``out``. With ``wire_dtype``, blocks that cross gRPC travel in that
        dtype, and every rank's block (its own included) is rounded to it,
        the same on every rank. Synchronization point. On failure ``out`` is
        unspecified."""
        me, name = self._me, "all_gather_into_tensor"
        with self._checks(name):
            validate.tensor(me, tensor, name)
            wire = validate.wire_dtype(me, wire_dtype, tensor, name)
            validate.tensor(me, out, name, "out")
            validate.writable(me, out, name, "out")
            validate.same_dtype(me, out, tensor, name)
            validate.same_device(me, out, tensor, name)
            w, m = me.world_size, tensor.numel()
            validate.numel(
                me, "out", out.numel(), f"world_size * tensor.numel() = {w} * {m}", w * m, name
            )
        self._engine.check_open()
        lo, hi = me.rank * m, (me.rank + 1) * m

        if self._placement.staged(out):
            source = tensor.detach().reshape(-1)

            def prefill(stage: Stage, device_out: torch.Tensor) -> None:
                # Only this rank's block is loaded; it is also copied into the
                # device result directly (rounded as the others will get it).
                stage.load_range(source, lo)
                own = source if wire is None else source.to(wire).to(source.dtype)
                stage.copier.copy(device_out[lo:hi], own)

            placed = self._placement.in_place(
                out,
                lambda flat: self._engine.number(pb.ALL_GATHER, "all_gather", flat, wire=wire),
                load=False,
                prefill=prefill,
            )
            return self._call(placed, lambda: out)

        def make(flat: torch.Tensor) -> Job:
            flat[lo:hi].copy_(tensor.reshape(-1))
            return self._engine.number(pb.ALL_GATHER, "all_gather", flat, wire=wire)

        return self._call(self._placement.in_place(out, make), lambda: out)

    def reduce_scatter(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        wire_dtype: torch.dtype | None = None,
    ) -> Call[torch.Tensor]:
        """Reduce ``tensor`` across ranks and return this rank's part,
        ``torch.tensor_split(tensor.flatten(), world_size)[rank]`` in shape.
        ``tensor`` is not modified. Ring reduce-scatter (one exchange when
        small; through shared memory on one host); ``wire_dtype`` as for
        :meth:`all_reduce`. Synchronization point."""
        with self._checks("reduce_scatter"):
            validate.tensor(self._me, tensor, "reduce_scatter")
            rop = validate.reduce_op(self._me, op, tensor, "reduce_scatter")
            wire = validate.wire_dtype(self._me, wire_dtype, tensor, "reduce_scatter")
        lo, hi = schedule.split_bounds(0, tensor.numel(), self.world_size)[self.rank]
        out = torch.empty(hi - lo, dtype=tensor.dtype, device=tensor.device)
        return self._reduce_scatter(out, tensor, rop, lo, "reduce_scatter", wire)

    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        wire_dtype: torch.dtype | None = None,
    ) -> Call[torch.Tensor]:
        """Reduce ``tensor`` across ranks into ``out``, this rank's equal part;
        ``tensor.numel()`` must be ``world_size * out.numel()``. Returns
        ``out``. ``tensor`` is not modified. Synchronization point."""
        me, name = self._me, "reduce_scatter_tensor"
        with self._checks(name):
            validate.tensor(me, tensor, name)
            validate.tensor(me, out, name, "out")
            validate.writable(me, out, name, "out")
            validate.same_dtype(me, out, tensor, name)
            validate.same_device(me, out, tensor, name)
            rop = validate.reduce_op(me, op, tensor, name)
            wire = validate.wire_dtype(me, wire_dtype, tensor, name)
            w, m = me.world_size, out.numel()
            validate.numel(
                me, "tensor", tensor.numel(), f"world_size * out.numel() = {w} * {m}", w * m, name
            )
        return self._reduce_scatter(out, tensor, rop, me.rank * m, "reduce_scatter", wire)

    def _reduce_scatter(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp,
        offset: int,
        name: str,
        wire: torch.dtype | None,
    ) -> Call[torch.Tensor]:
        self._engine.check_open()

        def make(source: torch.Tensor, flat_out: torch.Tensor) -> Job:
            return self._engine.number(
                pb.REDUCE_SCATTER, name, source, op, out=flat_out, out_offset=offset, wire=wire
            )

        return self._call(
            self._placement.reduce_scatter(out, tensor, make, offset, name), lambda: out
        )

    def all_to_all_single(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
        *,
        uniform: bool = False,
    ) -> Call[torch.Tensor]:
        """Send rows ``in_splits[r]`` of ``tensor`` (split along dim 0) to each
        rank r and receive ``out_splits[r]`` rows from each into ``out``, in
        rank order; splits left None are equal. Returns ``out``. One exchange
        of a message per pair of ranks (in parts of a chunk over gRPC); where
        one host holds the group, through its shared segments, the pieces of
        at most 64 KiB in the first message (shm_rounds).
        ``uniform``: every rank has one size and no splits (a small one may
        go direct: engine.number). Synchronization point: a size one rank
        sends and another does not expect is a ProtocolError naming both."""
        me, name = self._me, "all_to_all"
        with self._checks(name):
            validate.tensor(me, tensor, name)
            validate.tensor(me, out, name, "out")
            validate.writable(me, out, name, "out")
            validate.same_dtype(me, out, tensor, name)
            ins, outs = validate.all_to_all_splits(me, out, tensor, out_splits, in_splits, uniform)
        self._engine.check_open()
        source = tensor.detach().reshape(-1).to("cpu").contiguous()
        target, back = _landing(out)
        job = self._engine.number(pb.ALL_TO_ALL, name, source, out=target, uniform=uniform)
        job.splits = (ins, outs)
        return self._call(Placed(job, back), lambda: out)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Coroutine[Any, Any, None]:
        """Send ``tensor`` to rank ``dst``: not a collective. The n-th send
        to ``dst`` with ``tag`` matches ``dst``'s n-th ``recv`` from this rank
        with that tag (call order, taken when called). Returns once the
        message is handed to the transport. A failure breaks the group, as a
        collective's does. Bad arguments raise here, on this rank only: a
        send is between two ranks, and the matching ``recv`` waits for it
        until the collective deadline, as with torch's backends."""
        me = self._me
        validate.tensor(me, tensor, "send", dtypes=P2P_DTYPES)
        peer = validate.peer(me, dst, "send")
        validate.tag(me, tag, "send")
        self._engine.check_open()
        data = tensor.detach().reshape(-1).to("cpu").contiguous()
        n = self._p2p.take("send", peer, tag)
        job = Job(n, "send", pb.Descriptor(), data, ReduceOp.SUM)
        return self._engine.point_to_point(job, lambda: self._p2p.send(data, peer, tag, n), peer)

    def recv(
        self, tensor: torch.Tensor, src: int, tag: int = 0
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Receive into ``tensor`` the matching message from rank ``src``
        (see :meth:`send`); returns ``tensor``. A message of another dtype or
        size is a ProtocolError naming both ranks."""
        me = self._me
        validate.tensor(me, tensor, "recv", dtypes=P2P_DTYPES)
        validate.writable(me, tensor, "recv")
        peer = validate.peer(me, src, "recv")
        validate.tag(me, tag, "recv")
        self._engine.check_open()
        target, back = _landing(tensor)
        n = self._p2p.take("recv", peer, tag)
        job = Job(n, "recv", pb.Descriptor(), target, ReduceOp.SUM)

        async def run() -> torch.Tensor:
            await self._engine.point_to_point(
                job, lambda: self._p2p.recv(target, peer, tag, n), peer
            )
            back()
            return tensor

        return run()

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> Coroutine[Any, Any, int]:
        """Receive into ``tensor`` the next message with ``tag`` from any
        rank, whichever arrives first; returns the sender's rank. Each
        rank's messages are still taken in order (see :meth:`send`); a
        :meth:`recv` named for a rank, called meanwhile, takes its message
        first. Waits up to the collective deadline."""
        me = self._me
        validate.tensor(me, tensor, "recv", dtypes=P2P_DTYPES)
        validate.writable(me, tensor, "recv")
        validate.tag(me, tag, "recv")
        if me.world_size < 2:
            raise me.error(ConfigError, "a group of one has no other rank to receive from")
        self._engine.check_open()
        target, back = _landing(tensor)
        job = Job(-1, "recv", pb.Descriptor(), target, ReduceOp.SUM)
        sender = -1

        async def receive() -> None:
            nonlocal sender
            sender = await self._p2p.recv_any(target, tag)

        async def run() -> int:
            await self._engine.point_to_point(job, receive)
            back()
            return sender

        return run()

    def barrier(self) -> Call[None]:
        """Return once every rank has entered the barrier. Synchronization point."""
        self._engine.check_open()
        token = torch.zeros(self.world_size, dtype=torch.int32)
        return self._call(Placed(self._engine.number(pb.BARRIER, "barrier", token)), lambda: None)


def observer_of(peer: Peer) -> Observer:
    """What ``peer``'s rank saw: its flight recorder, and the sinks (metrics,
    trace) its settings asked for (ferrogrpc/observe/). Not on Peer itself,
    whose public surface is the collectives."""
    return peer._engine.observer


def _landing(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A flat CPU buffer to receive ``t``'s new contents (``t`` itself, viewed,
    where it is a contiguous CPU tensor), and what then copies it into ``t``."""
    host = t.detach()
    if host.device.type == "cpu" and host.is_contiguous():
        return host.view(-1), lambda: None
    target = torch.empty(t.numel(), dtype=t.dtype)

    def back() -> None:
        with torch.no_grad():
            t.copy_(target.view(t.shape))

    return target, back
