"""The asyncio peer: one per rank. It owns the transport, routes incoming
streams to the collective that waits for them, and runs the collectives."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import secrets
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch
from google.protobuf.message import DecodeError

from . import schedule, wire
from .collectives import Job, LaneRunner, build_plans
from .errors import (
    ERROR_CLASSES,
    CollectiveTimeoutError,
    ConfigError,
    FerroGrpcError,
    PeerError,
    ProtocolError,
)
from .integrity import checksum_kind
from .ops import DTYPE_TO_WIRE, OP_TO_WIRE, SUPPORTED_DTYPES, ReduceOp
from .options import ChunkPolicy, Timeouts, TLSConfig
from .rendezvous import Rendezvous
from .staging import Copier, CudaCopier, PinnedPool, Stage, host_view
from .transport import GrpcTransport, InStream, StreamHandler, Transport
from .v1 import collective_pb2 as pb

logger = logging.getLogger("ferrogrpc")

# How long a rank whose write failed ambiguously waits for another rank's
# report of the cause before reporting the failed write itself.
ECHO_GRACE_S = 1.0

# How long close() waits for abort notices still being delivered.
ABORT_DELIVERY_S = 2.0

# Streams for collectives this rank has not reached yet wait in mailboxes; a
# sender can run ahead, but not without bound.
MAX_UNCLAIMED_STREAMS = 4096

T = TypeVar("T")
MailboxKey = tuple[int, int, int, int]  # (group, seq, lane, src_rank)


class _Mailbox:
    """Where an incoming stream waits for the collective that consumes it."""

    __slots__ = ("arrived", "done")

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.arrived: asyncio.Future[tuple[pb.ChunkHeader, InStream]] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()


@dataclasses.dataclass
class Stats:
    """Bytes this peer moved, for throughput reports."""

    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0


@dataclasses.dataclass
class _Op:
    seq: int
    name: str
    task: asyncio.Task[Any] | None = None
    error: FerroGrpcError | None = None


class Peer(StreamHandler):
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

    def __init__(
        self,
        rank: int,
        world_size: int,
        transport: Transport,
        *,
        timeouts: Timeouts | None = None,
        chunk_policy: ChunkPolicy | None = None,
        checksum: Callable[[memoryview], int] | None = None,
        group: int = 0,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.transport = transport
        self.timeouts = timeouts or Timeouts()
        self.chunk_policy = chunk_policy or ChunkPolicy()
        self._chunking = self.chunk_policy.resolve(world_size)
        self.checksum = checksum
        self.stats = Stats()
        self.address = ""
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._mailboxes: dict[MailboxKey, _Mailbox] = {}
        self._ops: dict[int, _Op] = {}
        self._broken: FerroGrpcError | None = None
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()
        self._rendezvous: object | None = None
        self._broken_event = asyncio.Event()
        # This rank's session nonce and everyone's, from the rendezvous. Empty
        # nonces (a Peer built by hand) disable the check.
        self.nonce = ""
        self._nonces: list[str] = []
        # Sequence numbers handed out whose collective has not finished yet.
        self._pending: set[int] = set()
        # Device staging: pinned buffers, and (for tests) a copier that
        # stages even CPU tensors.
        self._pool: PinnedPool | None = None
        self._copier_factory: Callable[[torch.Tensor], Copier] | None = None
        self.log = logging.LoggerAdapter(logger, {"rank": rank})

    # ---------------------------------------------------------------- setup

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
        checksum: Callable[[memoryview], int] | bool | str | None = True,
        tls: TLSConfig | None = None,
        token: str | None = None,
    ) -> Peer:
        """Bind, join the rendezvous, connect, and return once every rank has.

        ``rank`` and ``world_size`` may be None when the rendezvous assigns
        them (the coordinator does). Without a ``rendezvous`` the env://
        TCPStore rendezvous at MASTER_ADDR:MASTER_PORT is used. Raises
        RendezvousError if the group is not complete within the connect
        timeout. ``tls`` (mutual TLS) and ``token`` (shared-token
        authentication) secure the default gRPC transport. ``checksum``
        (default on: CRC-32; ``"crc32c"`` or a function of the payload bytes
        otherwise) guards every chunk; all ranks must agree.
        """
        from .integrity import resolve_checksum

        if isinstance(checksum, (bool, str)):
            checksum = resolve_checksum(checksum)
        from ._malloc import tune_allocator
        from .rendezvous import StoreRendezvous

        tune_allocator()
        timeouts = timeouts or Timeouts()
        if transport is None:
            transport = GrpcTransport(f"{bind_host}:{port}", advertise_host, tls=tls, token=token)
        if rendezvous is None:
            rendezvous = StoreRendezvous.from_env(rank, world_size, timeout=timeouts.connect)
        # The handler must exist before the transport serves; rank is filled in
        # after the rendezvous when the coordinator assigns it.
        peer = cls.__new__(cls)
        holder = _Deferred()
        address = await transport.start(holder)
        nonce = secrets.token_hex(16)
        try:
            result = await rendezvous.exchange(rank, world_size, address, nonce)
            cls.__init__(
                peer,
                result.rank,
                result.world_size,
                transport,
                timeouts=timeouts,
                chunk_policy=chunk_policy,
                checksum=checksum,
            )
            peer.address = address
            peer.nonce = nonce
            peer._nonces = list(result.nonces)
            peer._rendezvous = rendezvous
            holder.bind(peer)
            transport.connect(result.addresses)
            if peer.world_size > 1:
                await peer._check_ring()
        except BaseException:
            await transport.close()
            await _close_rendezvous(rendezvous)
            raise
        start_heartbeats = getattr(rendezvous, "start_heartbeats", None)
        if start_heartbeats is not None:
            start_heartbeats(peer.current_collective)
        return peer

    def current_collective(self) -> tuple[str, int]:
        """The oldest collective in flight, as (name, seq), or ("", last seq)."""
        if self._ops:
            op = self._ops[min(self._ops)]
            return op.name, op.seq
        return "", self._seq

    async def _check_ring(self) -> None:
        try:
            async with asyncio.timeout(self.timeouts.connect):
                await self.barrier()
        except TimeoutError as exc:
            raise CollectiveTimeoutError(
                f"the ring did not form within {self.timeouts.connect:g}s", rank=self.rank
            ) from exc

    @property
    def broken(self) -> FerroGrpcError | None:
        """The failure that broke this peer, or None."""
        return self._broken

    def address_of(self, rank: int) -> str:
        addresses = self.transport.addresses
        return addresses[rank] if 0 <= rank < len(addresses) else "?"

    # --------------------------------------------------------------- errors

    def error(
        self,
        cls: type[FerroGrpcError],
        message: str,
        *,
        op: str | None = None,
        seq: int | None = None,
        peer: int | None = None,
    ) -> FerroGrpcError:
        return cls(
            message,
            rank=self.rank,
            world_size=self.world_size,
            op=op,
            seq=seq,
            peer=peer,
            peer_address=self.address_of(peer) if peer is not None else None,
        )

    def contextualize(
        self, exc: FerroGrpcError, op: str, seq: int, peer: int | None
    ) -> FerroGrpcError:
        """Fill in this rank's identity on an error raised without it."""
        if exc.rank is not None:
            return exc
        culprit = exc.peer if exc.peer is not None else peer
        err = self.error(type(exc), exc.message, op=op, seq=seq, peer=culprit)
        err.echo = exc.echo
        err.reported = exc.reported
        return err

    def _check_open(self) -> None:
        if self._closed:
            raise self.error(ConfigError, "this peer is closed")
        if self._broken is not None:
            broken = self._broken
            raise self.error(
                type(broken),
                f"the group is broken by an earlier failure: {broken}",
                peer=broken.peer,
            ) from broken

    # --------------------------------------------------------- stream intake

    def mailbox(self, key: MailboxKey) -> _Mailbox:
        box = self._mailboxes.get(key)
        if box is None:
            box = self._mailboxes[key] = _Mailbox()
        return box

    def drop_mailbox(self, key: MailboxKey) -> None:
        self._mailboxes.pop(key, None)

    def _verify_nonce(self, rank: int, nonce: str, what: str, origin: str) -> None:
        if not self._nonces:
            return
        expected = self._nonces[rank] if 0 <= rank < len(self._nonces) else ""
        if not hmac.compare_digest(expected.encode(), nonce.encode()):
            raise ProtocolError(
                f"{what} from {origin} claims to be rank {rank} but does not carry rank {rank}'s "
                "session nonce; refused"
            )

    async def handle_stream(self, first: bytes, stream: InStream, origin: str) -> None:
        header, _ = wire.decode(first)
        if not header.HasField("descriptor"):
            raise ProtocolError(f"stream from {origin} does not start with a descriptor")
        if header.group != self.group or header.src_rank >= self.world_size:
            raise ProtocolError(
                f"stream from {origin} claims group {header.group} rank {header.src_rank}; "
                f"this is group {self.group} of {self.world_size} ranks"
            )
        if header.src_rank != (self.rank - 1) % self.world_size:
            raise ProtocolError(
                f"stream from {origin} claims rank {header.src_rank}, which is not this rank's "
                "left neighbour"
            )
        self._verify_nonce(header.src_rank, header.nonce, "a stream", origin)
        if header.seq <= self._seq and header.seq not in self._pending:
            raise ProtocolError(
                f"stream from {origin} for seq {header.seq}, which this rank already finished"
            )
        key = (header.group, header.seq, header.lane, header.src_rank)
        if key not in self._mailboxes and len(self._mailboxes) >= MAX_UNCLAIMED_STREAMS:
            raise ProtocolError(f"too many streams waiting for collectives; refused {origin}")
        box = self.mailbox(key)
        if box.arrived.done():
            raise ProtocolError(
                f"duplicate stream for seq {header.seq} lane {header.lane} from {origin}"
            )
        box.arrived.set_result((header, stream))
        try:
            async with asyncio.timeout(self.timeouts.collective):
                await asyncio.shield(box.done)
        except TimeoutError:
            raise ProtocolError(
                f"stream for seq {header.seq} from rank {header.src_rank} was never consumed: "
                "this rank did not run that collective"
            ) from None
        finally:
            if not box.done.done():
                # The sender went away before we finished reading it.
                box.done.cancel()
            self.drop_mailbox(key)

    async def handle_abort(self, message: bytes) -> None:
        try:
            abort = pb.Abort.FromString(message)
        except DecodeError as exc:
            raise ProtocolError(f"undecodable abort message: {exc}") from exc
        if abort.from_rank >= self.world_size or abort.from_rank == self.rank:
            raise ProtocolError(f"abort from unknown rank {abort.from_rank}")
        self._verify_nonce(abort.from_rank, abort.nonce, "an abort", f"rank {abort.from_rank}")
        self._break(self.error_from_abort(abort), broadcast=False)

    def error_from_abort(self, abort: pb.Abort) -> FerroGrpcError:
        """The error another rank reported, as this rank raises it."""
        cls = ERROR_CLASSES.get(abort.error, PeerError)
        culprit = abort.culprit if 0 <= abort.culprit < self.world_size else None
        op = self._ops.get(abort.seq)
        err = self.error(
            cls,
            f"rank {abort.from_rank} reported: {abort.message}",
            op=op.name if op else None,
            seq=abort.seq,
            peer=culprit,
        )
        err.reported = True
        return err

    def abort_message(self, err: FerroGrpcError) -> pb.Abort:
        return pb.Abort(
            group=self.group,
            seq=err.seq or 0,
            from_rank=self.rank,
            error=type(err).__name__,
            message=str(err),
            culprit=err.peer if err.peer is not None else -1,
            nonce=self.nonce,
        )

    def _break(self, err: FerroGrpcError, *, broadcast: bool) -> None:
        """Enter the broken state: fail every running collective with ``err``
        and, when this rank found the failure, tell the others."""
        first = self._broken is None
        if first:
            self._broken = err
            self._broken_event.set()
        for op in list(self._ops.values()):
            if op.error is None and op.task is not None and not op.task.done():
                op.error = err
                op.task.cancel()
        if broadcast and first:
            abort = self.abort_message(err).SerializeToString()
            for dst in range(self.world_size):
                if dst != self.rank:
                    self._spawn(self._send_abort(dst, abort))

    async def _send_abort(self, dst: int, abort: bytes) -> None:
        try:
            await self.transport.send_abort(dst, abort, timeout=2.0)
        except FerroGrpcError as exc:
            self.log.debug("abort to rank %d not delivered: %s", dst, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ----------------------------------------------------------- running ops

    def _next_seq(self) -> int:
        with self._seq_lock:
            seq = self._seq + 1
            # Pending before visible: handle_stream reads _seq without the lock
            # and must never see a new seq that is not yet pending.
            if self.world_size > 1:
                self._pending.add(seq)
            self._seq = seq
            return seq

    def _job(
        self,
        kind: int,
        name: str,
        buffer: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        root: int = 0,
        out: torch.Tensor | None = None,
        out_offset: int = 0,
    ) -> Job:
        seq = self._next_seq()
        nbytes = buffer.numel() * buffer.element_size()
        policy = self.chunk_policy
        chunk_bytes, max_lanes = self._chunking
        lanes = schedule.lane_count(nbytes, max_lanes, policy.lane_min_bytes)
        descriptor = pb.Descriptor(
            kind=kind,  # type: ignore[arg-type]
            dtype=DTYPE_TO_WIRE[buffer.dtype],  # type: ignore[arg-type]
            numel=buffer.numel(),
            reduce_op=OP_TO_WIRE[op] if kind in (pb.ALL_REDUCE, pb.REDUCE_SCATTER) else 0,  # type: ignore[arg-type]
            root=root,
            world_size=self.world_size,
            lanes=lanes,
            chunk_elems=schedule.chunk_elems_for(chunk_bytes, buffer.element_size()),
            checksum=checksum_kind(self.checksum),  # type: ignore[arg-type]
        )
        return Job(seq, name, descriptor, buffer, op, out, out_offset)

    async def _execute(self, job: Job) -> None:
        try:
            self._check_open()
        except FerroGrpcError:
            # Broken or closed since the call took its sequence number (a
            # chained DDP bucket behind a failed one): release what the call
            # set up.
            if job.stage is not None and not job.stage.finished:
                await job.stage.abandon()
            self._pending.discard(job.seq)
            raise
        op = _Op(job.seq, job.name)
        self._ops[job.seq] = op
        plans = build_plans(
            job, self.rank, self.world_size, job.descriptor.lanes, job.descriptor.root
        )
        runners = [LaneRunner(self, job, lane, plan) for lane, plan in enumerate(plans)]
        op.task = asyncio.ensure_future(_run_all(runners))
        try:
            async with asyncio.timeout(self.timeouts.collective) as deadline:
                await op.task
                if job.stage is not None:
                    await job.stage.finish()
        except asyncio.CancelledError:
            if op.error is not None:
                raise op.error from None
            raise
        except TimeoutError as exc:
            if isinstance(exc, FerroGrpcError) or not deadline.expired():
                raise
            err = self.error(
                CollectiveTimeoutError,
                f"did not finish within the {self.timeouts.collective:g}s collective deadline",
                op=job.name,
                seq=job.seq,
            )
            self._break(err, broadcast=True)
            raise err from None
        except FerroGrpcError as exc:
            raise await self._failed(job, exc) from exc.__cause__
        except BaseExceptionGroup as group:
            err = _first_ferro(group) or self.error(
                PeerError, f"internal failure: {group!r}", op=job.name, seq=job.seq
            )
            raise await self._failed(job, err) from group
        finally:
            if job.stage is not None and not job.stage.finished:
                await job.stage.abandon()
            self._ops.pop(job.seq, None)
            self._pending.discard(job.seq)
            self.stats.collectives += 1

    async def _await_report(self, named: int | None) -> None:
        """A symptom (a stream that ended, a write that failed) names the
        neighbour it came from, which may only have failed because of
        something else. Wait up to ECHO_GRACE_S for a rank's report of the
        cause, and meanwhile ping the named neighbour: one that does not
        answer is the cause itself, and the symptom stands at once; one that
        answers is alive, and its report is given up to twice as long."""
        report = asyncio.ensure_future(self._broken_event.wait())
        waits: set[asyncio.Future[Any]] = {report}
        ping: asyncio.Future[None] | None = None
        if named is not None and named != self.rank:
            ping = asyncio.ensure_future(self.transport.ping(named, timeout=ECHO_GRACE_S))
            waits.add(ping)
        try:
            deadline = asyncio.get_running_loop().time() + ECHO_GRACE_S
            while not report.done():
                left = deadline - asyncio.get_running_loop().time()
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
            for task in (report, ping):
                if task is not None and not task.done():
                    task.cancel()

    async def _failed(self, job: Job, exc: FerroGrpcError) -> FerroGrpcError:
        """Decide what a failed collective raises, and tell the other ranks."""
        if exc.echo and self._broken is None:
            await self._await_report(exc.peer)
        err = self.contextualize(exc, job.name, job.seq, None)
        if (
            isinstance(err, ProtocolError)
            and not err.echo
            and not err.reported
            and err.seq == job.seq
        ):
            # What this rank found itself in this collective's data (a
            # checksum or header failure) is its account, even when another
            # rank's relay of that same finding arrived first. Symptoms such
            # as a refused stream still defer to a root cause reported.
            self._break(err, broadcast=True)
            return err
        if self._broken is not None:
            broken = self._broken
            if broken.seq == job.seq or broken.op is None:
                return self.error(
                    type(broken), broken.message, op=job.name, seq=job.seq, peer=broken.peer
                )
            return self.error(
                type(broken),
                f"aborted because {broken.op}#{broken.seq} failed: {broken.message}",
                op=job.name,
                seq=job.seq,
                peer=broken.peer,
            )
        self._break(err, broadcast=True)
        return err

    # ------------------------------------------------------- input checking

    def _check_tensor(self, tensor: object, name: str, what: str = "tensor") -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise self.error(
                ConfigError,
                f"{what} has unsupported dtype {tensor.dtype}; supported: {supported}",
                op=name,
            )
        if tensor.is_sparse:
            raise self.error(ConfigError, f"{what} is sparse; pass a dense tensor", op=name)
        return tensor

    def _check_op(self, op: ReduceOp | str, tensor: torch.Tensor, name: str) -> ReduceOp:
        try:
            rop = ReduceOp.coerce(op)
        except ConfigError as exc:
            raise self.error(ConfigError, exc.message, op=name) from None
        if rop is ReduceOp.MEAN and not tensor.is_floating_point():
            raise self.error(
                ConfigError, f"MEAN is not defined for integer dtype {tensor.dtype}", op=name
            )
        return rop

    # ---------------------------------------------------------- collectives

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Reduce ``tensor`` across all ranks, in place; returns ``tensor``.

        Ring reduce-scatter then ring all-gather: each rank sends and receives
        2(n-1)/n of the tensor. Every rank ends with bitwise identical values.
        Synchronization point. On failure the tensor's contents are
        unspecified (partly reduced): keep a copy if you need to retry.
        """
        self._check_tensor(tensor, "all_reduce")
        rop = self._check_op(op, tensor, "all_reduce")
        self._check_open()
        return self._in_place(
            tensor, lambda flat: self._job(pb.ALL_REDUCE, "all_reduce", flat, rop)
        )

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Coroutine[Any, Any, torch.Tensor]:
        """Copy ``root``'s tensor into every rank's ``tensor``, in place.

        A pipelined chain in ring order from the root: each rank forwards a
        chunk as soon as it has it. Synchronization point. On failure the
        tensor's contents are unspecified on non-root ranks.
        """
        self._check_tensor(tensor, "broadcast")
        self._check_root(root, "broadcast")
        self._check_open()
        return self._in_place(
            tensor,
            lambda flat: self._job(pb.BROADCAST, "broadcast", flat, root=root),
            load=self.rank == root,
            store=self.rank != root,
        )

    def _check_root(self, root: object, name: str) -> None:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world_size:
            raise self.error(
                ConfigError, f"root must be a rank in [0, {self.world_size}), got {root!r}", op=name
            )

    def _in_place(
        self,
        tensor: torch.Tensor,
        make: Callable[[torch.Tensor], Job],
        *,
        load: bool = True,
        store: bool = True,
        prefill: Callable[[Stage, torch.Tensor], None] | None = None,
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Run ``make(flat)``'s job over ``tensor`` in place. Device tensors
        are staged through a pinned host buffer (see staging.py): ``load``
        says whether the ring needs the tensor's contents, ``store`` whether
        the result is written back."""
        if self.world_size > 1 and self._staged(tensor):
            return self._in_place_staged(tensor, make, load, store, prefill)
        staged, flat = _flat_host(tensor)
        job = make(flat)

        async def run() -> torch.Tensor:
            if self.world_size > 1:
                await self._execute(job)
            else:
                self._check_open()
            _copy_back(tensor, staged)
            return tensor

        return run()

    def _staged(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type != "cpu" or self._copier_factory is not None

    def _copier(self, tensor: torch.Tensor) -> Copier:
        if self._copier_factory is not None:
            return self._copier_factory(tensor)
        if tensor.device.type != "cuda":
            raise self.error(
                ConfigError, f"tensors on {tensor.device.type} are not supported; use cpu or cuda"
            )
        return CudaCopier(tensor.device)

    @property
    def _pinned(self) -> PinnedPool:
        if self._pool is None:
            self._pool = PinnedPool(pin=torch.cuda.is_available())
        return self._pool

    def _in_place_staged(
        self,
        tensor: torch.Tensor,
        make: Callable[[torch.Tensor], Job],
        load: bool,
        store: bool,
        prefill: Callable[[Stage, torch.Tensor], None] | None,
    ) -> Coroutine[Any, Any, torch.Tensor]:
        work = tensor.detach()
        if not work.is_contiguous():
            work = work.contiguous()
        device_flat = work.view(-1)
        copier = self._copier(tensor)  # may refuse the device: before taking a seq
        raw = self._pinned.acquire(work.numel() * work.element_size())
        host = host_view(raw, work.dtype, work.numel())
        job = make(host)
        stage = Stage(
            copier,
            self._pinned,
            host,
            load=device_flat if load else None,
            load_at=0,
            store=device_flat if store else None,
            result=host,
            store_at=0,
            chunk_elems=job.descriptor.chunk_elems,
            release=[raw],
        )
        if prefill is not None:
            prefill(stage, device_flat)
        job.stage = stage
        copy_back = work is not tensor.detach() and work.data_ptr() != tensor.data_ptr()

        async def run() -> torch.Tensor:
            await self._execute(job)
            if copy_back:
                copier.then(lambda: tensor.detach().copy_(work))
            return tensor

        return run()

    def all_gather(self, tensor: torch.Tensor) -> Coroutine[Any, Any, list[torch.Tensor]]:
        """Gather every rank's ``tensor``; returns one tensor per rank, in rank
        order, each shaped like ``tensor``. Ring all-gather. Synchronization
        point."""
        self._check_tensor(tensor, "all_gather")
        self._check_open()
        out = torch.empty(
            (self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        gathered = self.all_gather_into_tensor(out, tensor)

        async def run() -> list[torch.Tensor]:
            await gathered
            return list(out.unbind(0))

        return run()

    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Gather every rank's ``tensor`` into ``out`` (rank-major);
        ``out.numel()`` must be ``world_size * tensor.numel()``. Returns
        ``out``. Synchronization point. On failure ``out`` is unspecified."""
        self._check_tensor(tensor, "all_gather_into_tensor")
        self._check_tensor(out, "all_gather_into_tensor", "out")
        self._check_same_dtype(out, tensor, "all_gather_into_tensor")
        if out.device != tensor.device:
            raise self.error(
                ConfigError,
                f"tensor is on {tensor.device} but out is on {out.device}",
                op="all_gather_into_tensor",
            )
        if out.numel() != self.world_size * tensor.numel():
            raise self.error(
                ConfigError,
                f"out has {out.numel()} elements; expected world_size * tensor.numel() = "
                f"{self.world_size} * {tensor.numel()} = {self.world_size * tensor.numel()}",
                op="all_gather_into_tensor",
            )
        self._check_open()
        m = tensor.numel()
        r = self.rank

        if self.world_size > 1 and self._staged(out):
            source = tensor.detach().reshape(-1)

            def prefill(stage: Stage, device_out: torch.Tensor) -> None:
                # Only this rank's block is loaded; it is also copied into the
                # device result directly.
                stage.load_range(source, r * m)
                stage.copier.copy(device_out[r * m : (r + 1) * m], source)

            return self._in_place(
                out,
                lambda flat: self._job(pb.ALL_GATHER, "all_gather", flat),
                load=False,
                prefill=prefill,
            )

        def make(flat: torch.Tensor) -> Job:
            flat[r * m : (r + 1) * m].copy_(tensor.reshape(-1))
            return self._job(pb.ALL_GATHER, "all_gather", flat)

        return self._in_place(out, make)

    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Reduce ``tensor`` across ranks and return this rank's part,
        ``torch.tensor_split(tensor.flatten(), world_size)[rank]`` in shape.
        ``tensor`` is not modified. Ring reduce-scatter. Synchronization point."""
        self._check_tensor(tensor, "reduce_scatter")
        rop = self._check_op(op, tensor, "reduce_scatter")
        lo, hi = schedule.split_bounds(0, tensor.numel(), self.world_size)[self.rank]
        out = torch.empty(hi - lo, dtype=tensor.dtype, device=tensor.device)
        return self._reduce_scatter(out, tensor, rop, lo, "reduce_scatter")

    def reduce_scatter_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM
    ) -> Coroutine[Any, Any, torch.Tensor]:
        """Reduce ``tensor`` across ranks into ``out``, this rank's equal part;
        ``tensor.numel()`` must be ``world_size * out.numel()``. Returns
        ``out``. ``tensor`` is not modified. Synchronization point."""
        self._check_tensor(tensor, "reduce_scatter_tensor")
        self._check_tensor(out, "reduce_scatter_tensor", "out")
        self._check_same_dtype(out, tensor, "reduce_scatter_tensor")
        rop = self._check_op(op, tensor, "reduce_scatter_tensor")
        if tensor.numel() != self.world_size * out.numel():
            raise self.error(
                ConfigError,
                f"tensor has {tensor.numel()} elements; expected world_size * out.numel() = "
                f"{self.world_size} * {out.numel()} = {self.world_size * out.numel()}",
                op="reduce_scatter_tensor",
            )
        return self._reduce_scatter(out, tensor, rop, self.rank * out.numel(), "reduce_scatter")

    def _reduce_scatter(
        self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, offset: int, name: str
    ) -> Coroutine[Any, Any, torch.Tensor]:
        self._check_open()
        if self.world_size > 1 and (self._staged(tensor) or self._staged(out)):
            return self._reduce_scatter_staged(out, tensor, op, offset, name)
        source = tensor.detach().contiguous().reshape(-1)
        staged_out, flat_out = _flat_host(out)
        job = self._job(pb.REDUCE_SCATTER, name, source, op, out=flat_out, out_offset=offset)

        async def run() -> torch.Tensor:
            if self.world_size > 1:
                await self._execute(job)
            else:
                self._check_open()
                flat_out.copy_(source)
            _copy_back(out, staged_out)
            return out

        return run()

    def _reduce_scatter_staged(
        self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, offset: int, name: str
    ) -> Coroutine[Any, Any, torch.Tensor]:
        source = tensor.detach().reshape(-1)
        if not source.is_contiguous():
            source = source.contiguous()
        work = out.detach()
        if not work.is_contiguous():
            work = work.contiguous()
        if tensor.device != out.device:
            raise self.error(
                ConfigError,
                f"tensor is on {tensor.device} but out is on {out.device}",
                op=name,
            )
        copier = self._copier(tensor)  # may refuse the device: before taking a seq
        pool = self._pinned
        raw_in = pool.acquire(source.numel() * source.element_size())
        raw_out = pool.acquire(work.numel() * work.element_size())
        host_in = host_view(raw_in, source.dtype, source.numel())
        host_out = host_view(raw_out, work.dtype, work.numel())
        job = self._job(pb.REDUCE_SCATTER, name, host_in, op, out=host_out, out_offset=offset)
        job.stage = Stage(
            copier,
            pool,
            host_in,
            load=source,
            load_at=0,
            store=work.view(-1),
            result=host_out,
            store_at=offset,
            chunk_elems=job.descriptor.chunk_elems,
            release=[raw_in, raw_out],
        )
        copy_back = work.data_ptr() != out.data_ptr()

        async def run() -> torch.Tensor:
            await self._execute(job)
            if copy_back:
                copier.then(lambda: out.detach().copy_(work))
            return out

        return run()

    def _check_same_dtype(self, out: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if out.dtype != tensor.dtype:
            raise self.error(
                ConfigError, f"out has dtype {out.dtype} but tensor has {tensor.dtype}", op=name
            )

    def barrier(self) -> Coroutine[Any, Any, None]:
        """Return once every rank has entered the barrier. Synchronization point."""
        self._check_open()
        token = torch.zeros(self.world_size, dtype=torch.int32)
        job = self._job(pb.BARRIER, "barrier", token)

        async def run() -> None:
            if self.world_size > 1:
                await self._execute(job)

        return run()

    # ---------------------------------------------------------------- close

    async def close(self) -> None:
        """Stop serving and close every connection. Idempotent. Running
        collectives fail with PeerError."""
        if self._closed:
            return
        self._closed = True
        err = self.error(PeerError, "the peer was closed while this collective ran")
        for op in list(self._ops.values()):
            if op.error is None and op.task is not None and not op.task.done():
                op.error = err
                op.task.cancel()
        if self._background:
            # Abort notices still in flight carry the cause of a failure to the
            # other ranks: let them land before the connections go.
            await asyncio.wait(list(self._background), timeout=ABORT_DELIVERY_S)
        for task in list(self._background):
            task.cancel()
        await self.transport.close()
        await _close_rendezvous(self._rendezvous)

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Deferred(StreamHandler):
    """Holds streams that arrive before the rendezvous finished (a fast
    neighbour's barrier) until the peer exists."""

    def __init__(self) -> None:
        self._peer: asyncio.Future[Peer] = asyncio.get_running_loop().create_future()

    def bind(self, peer: Peer) -> None:
        self._peer.set_result(peer)

    async def handle_stream(self, first: bytes, stream: InStream, origin: str) -> None:
        peer = await self._peer
        await peer.handle_stream(first, stream, origin)

    async def handle_abort(self, message: bytes) -> None:
        peer = await self._peer
        await peer.handle_abort(message)


async def _close_rendezvous(rendezvous: object) -> None:
    close = getattr(rendezvous, "close", None)
    if close is not None:
        await close()


async def _run_all(runners: list[LaneRunner]) -> None:
    if len(runners) == 1:
        await runners[0].run()
        return
    async with asyncio.TaskGroup() as tg:
        for runner in runners:
            tg.create_task(runner.run())


def _first_ferro(group: BaseExceptionGroup[BaseException]) -> FerroGrpcError | None:
    for exc in group.exceptions:
        if isinstance(exc, FerroGrpcError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_ferro(exc)
            if found is not None:
                return found
    return None


def _flat_host(tensor: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A flat contiguous view of a CPU tensor to run the ring on, and the
    contiguous copy (if the tensor was not contiguous) to copy back with
    :func:`_copy_back`. Device tensors take the staged path instead."""
    t = tensor.detach()
    if t.is_contiguous():
        return None, t.view(-1)
    copy = t.contiguous()
    return copy, copy.view(-1)


def _copy_back(tensor: torch.Tensor, copy: torch.Tensor | None) -> None:
    if copy is not None:
        with torch.no_grad():
            tensor.copy_(copy.view(tensor.shape))
