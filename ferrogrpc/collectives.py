"""The async driver: runs one lane of a ring or chain plan over a transport.

For each lane a rank runs two tasks. The sender streams the plan's send items
to the right neighbour, each as soon as the receive item it forwards has been
applied. The receiver reads the left neighbour's stream, checks every header
against the plan, and reduces or copies the payload into place. Both sides
start with a descriptor message, which the receiver compares with its own
view of the collective: any difference is a ProtocolError naming both ranks
and both values.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from . import integrity, schedule, wire
from .errors import CollectiveTimeoutError, FerroGrpcError, PeerError, ProtocolError
from .ops import ReduceOp, kind_name, wire_dtype_name, wire_op_name
from .schedule import COPY, REDUCE, LanePlan
from .staging import Stage
from .transport import InStream, OutStream
from .v1 import collective_pb2 as pb

if TYPE_CHECKING:
    from .peer import Peer

T = TypeVar("T")


class Counter:
    """A monotonic counter that coroutines can wait on."""

    __slots__ = ("_waiters", "value")

    def __init__(self) -> None:
        self.value = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def advance(self) -> None:
        self.value += 1
        if self._waiters:
            keep = []
            for threshold, fut in self._waiters:
                if threshold <= self.value:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((threshold, fut))
            self._waiters = keep

    async def wait_for(self, threshold: int) -> None:
        if self.value >= threshold:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((threshold, fut))
        await fut


# Reductions applied to a received chunk: out = a (op) b.
_REDUCERS: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    ReduceOp.SUM: lambda a, b, out: torch.add(a, b, out=out),
    ReduceOp.MEAN: lambda a, b, out: torch.add(a, b, out=out),
    ReduceOp.MAX: lambda a, b, out: torch.maximum(a, b, out=out),
    ReduceOp.MIN: lambda a, b, out: torch.minimum(a, b, out=out),
}

# After this long without progress a lane checks that the neighbours it waits
# for can still be reached (see LaneRunner._watchdog).
PROBE_S = 2.0

# Forwarded messages a lane may hold ready for its sender (see LaneRunner):
# at most this many, and at most this many bytes (but one message at least).
HELD_MESSAGES = 3
HELD_BYTES = 8 << 20

# How long a failing rank tries to hand its right neighbour the cause in band.
ABORT_WRITE_S = 0.5

_DESCRIPTOR_FIELDS = (
    ("kind", kind_name),
    ("dtype", wire_dtype_name),
    ("numel", str),
    ("reduce_op", wire_op_name),
    ("root", str),
    ("world_size", str),
    ("lanes", str),
    ("chunk_elems", str),
    ("checksum", integrity.kind_name),
)


@dataclasses.dataclass
class Job:
    """One collective as this rank sees it."""

    seq: int
    name: str
    descriptor: pb.Descriptor
    # The flat tensor the ring reads from and (in place) writes to.
    buffer: torch.Tensor
    op: ReduceOp
    # For out-of-place reduce-scatter: where the finished segment goes, and the
    # element offset of that segment in ``buffer``.
    out: torch.Tensor | None = None
    out_offset: int = 0
    # Device staging (see staging.py), or None for host tensors.
    stage: Stage | None = None

    @property
    def kind(self) -> int:
        return self.descriptor.kind


def describe_mismatch(mine: pb.Descriptor, theirs: pb.Descriptor, me: int, them: int) -> str | None:
    for field, render in _DESCRIPTOR_FIELDS:
        a = getattr(mine, field)
        b = getattr(theirs, field)
        if a != b:
            return (
                f"ranks disagree on {field}: rank {me} has {field}={render(a)}, "
                f"rank {them} has {field}={render(b)}"
            )
    return None


class LaneRunner:
    """Runs one lane of one collective on one rank."""

    def __init__(self, peer: Peer, job: Job, lane: int, plan: LanePlan) -> None:
        self.peer = peer
        self.job = job
        self.lane = lane
        self.plan = plan
        self.world = peer.world_size
        self.right = (peer.rank + 1) % self.world
        self.left = (peer.rank - 1) % self.world
        self.itemsize = job.buffer.element_size()
        self.received = Counter()
        # Messages ready to forward, by receive index: a received chunk that is
        # copied travels on unchanged (its header names where it came from
        # and carries its verified checksum); a partial sum is reduced
        # straight into the message that carries it on. That saves the copy
        # into a new message at send time, but holds the message until the
        # sender gets to it; so only while the sender keeps up (at most
        # hold_limit waiting: HELD_MESSAGES, fewer where that would exceed
        # HELD_BYTES). Beyond that, results go to the tensor and the sender
        # frames them from there, as for its own data.
        self.outgoing: dict[int, bytes] = {}
        largest = max((item.hi - item.lo for item in plan.recvs), default=0) * self.itemsize
        self.hold_limit = min(HELD_MESSAGES, max(1, HELD_BYTES // max(largest, 1)))
        # For each receive index that is forwarded, the send item forwarding it.
        self.forwards = {item.from_recv: item for item in plan.sends if item.from_recv >= 0}
        self.in_place = job.out is None
        # The outgoing stream, until it has been closed cleanly.
        self.out: OutStream | None = None
        # For the watchdog: what each side ("send", "recv") is waiting for,
        # as (neighbour, description), and when anything last completed.
        self.waiting: dict[str, tuple[int, str]] = {}
        self.progress_at = time.monotonic()
        # The first of this lane's tasks to fail, and why (see run()).
        self.failure: Exception | None = None

    def _error(self, cls: type[FerroGrpcError], message: str, peer: int | None) -> FerroGrpcError:
        return self.peer.error(cls, message, op=self.job.name, seq=self.job.seq, peer=peer)

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                work = [
                    tg.create_task(self._first_failure(self._send())),
                    tg.create_task(self._first_failure(self._receive())),
                ]
                tg.create_task(self._first_failure(self._watchdog(work)))
        except BaseException as exc:
            await self._abort_downstream(exc)
            raise

    async def _first_failure(self, work: Awaitable[None]) -> None:
        """Run one of the lane's tasks, noting the first failure among them
        before the TaskGroup cancels the others: a task cancelled because of
        it then reports that cause, not its own cancellation."""
        try:
            await work
        except Exception as exc:
            if self.failure is None:
                self.failure = exc
            raise

    def _cause(self, exc: BaseException) -> FerroGrpcError:
        if isinstance(exc, FerroGrpcError):
            return self.peer.contextualize(exc, self.job.name, self.job.seq, None)
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                if not isinstance(inner, asyncio.CancelledError):
                    return self._cause(inner)
        if self.failure is not None and self.failure is not exc:
            # Cancelled because a sibling task failed: that is the cause.
            return self._cause(self.failure)
        broken = self.peer.broken
        if broken is not None:
            return broken
        return self._error(PeerError, f"the collective was interrupted ({exc!r})", None)

    async def _abort_downstream(self, exc: BaseException) -> None:
        """Tell the right neighbour why, in band, before the stream ends: so it
        reports the root cause instead of "the stream ended"."""
        stream, self.out = self.out, None
        if stream is None:
            return
        header = self._header()
        header.abort.CopyFrom(self.peer.abort_message(self._cause(exc)))
        try:
            async with asyncio.timeout(ABORT_WRITE_S):
                await stream.write(wire.encode(header))
                await stream.close()
        except (Exception, asyncio.CancelledError):
            # Best effort. A CancelledError here is the TaskGroup's own request
            # to stop this task, still pending from the failure being handled;
            # the caller re-raises that failure (or the cancellation) next.
            pass
        finally:
            stream.cancel()

    # ------------------------------------------------------------- sending

    def _header(self) -> pb.ChunkHeader:
        return pb.ChunkHeader(
            group=self.peer.group,
            seq=self.job.seq,
            kind=self.job.kind,  # type: ignore[arg-type]
            src_rank=self.peer.rank,
            lane=self.lane,
        )

    async def _waiting(self, side: str, neighbour: int, what: str, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` while the watchdog knows what this side waits
        for; record progress when it completes."""
        self.waiting[side] = (neighbour, what)
        try:
            result = await awaitable
        except FerroGrpcError as exc:
            raise self.peer.contextualize(exc, self.job.name, self.job.seq, neighbour) from exc
        finally:
            self.waiting.pop(side, None)
        self.progress_at = time.monotonic()
        return result

    async def _watchdog(self, work: list[asyncio.Task[None]]) -> None:
        """Each time a whole idle timeout passes without progress, ask the
        neighbours this lane waits for whether they are alive. One whose
        event loop answers is only waiting itself (upstream in the ring, or
        busy with rank-local work before the collective) and is waited for,
        up to the collective's deadline; one that does not answer is stuck,
        and named. Sooner than that, after PROBE_S without progress, it
        checks that those neighbours can be reached at all: one whose server
        refuses connections twice in a row (its process is gone, say after
        an exception in the training script) is named at once instead of
        after the idle timeout. Costs nothing per chunk."""
        idle = self.peer.timeouts.idle
        probe = min(PROBE_S, idle)
        refused: set[int] = set()
        while True:
            done, _ = await asyncio.wait(work, timeout=min(idle / 4, probe))
            if len(done) == len(work):
                return
            stalled = time.monotonic() - self.progress_at
            if stalled < probe:
                refused.clear()  # progress since: refusals must be consecutive
                continue
            if stalled < idle:
                await self._probe(probe, refused)
                continue
            for neighbour, what in list(self.waiting.values()):
                try:
                    await self.peer.transport.ping(neighbour, timeout=idle)
                except FerroGrpcError as exc:
                    raise self._error(
                        CollectiveTimeoutError,
                        f"waited {idle:g}s for {what} rank {neighbour} "
                        f"({self.peer.address_of(neighbour)}), which does not answer: it is "
                        f"stuck ({exc.message})",
                        neighbour,
                    ) from None
            self.progress_at = time.monotonic()

    async def _probe(self, timeout: float, refused: set[int]) -> None:
        """Raise PeerError for a waited-for neighbour whose server refused
        two probes in a row; an answer, or no answer yet, is left to the
        idle-timeout check."""
        for neighbour, what in list(self.waiting.values()):
            try:
                await self.peer.transport.ping(neighbour, timeout=timeout)
            except FerroGrpcError as exc:
                if not exc.gone:
                    refused.discard(neighbour)  # reachable, if slow: not gone
                    continue
                if neighbour in refused:
                    raise self._error(
                        PeerError,
                        f"waiting for {what} rank {neighbour} "
                        f"({self.peer.address_of(neighbour)}), which is gone: its server "
                        f"refuses connections ({exc.message})",
                        neighbour,
                    ) from None
                refused.add(neighbour)
            else:
                refused.discard(neighbour)

    async def _write(self, stream: OutStream, message: bytes, step: int) -> None:
        await self._waiting(
            "send", self.right, f"step {step} to be accepted by", stream.write(message)
        )

    async def _send(self) -> None:
        peer = self.peer
        stream = await peer.transport.open(self.right, self.lane)
        self.out = stream
        header = self._header()
        header.descriptor.CopyFrom(self.job.descriptor)
        header.nonce = peer.nonce
        await self._write(stream, wire.encode(header), 0)
        header.ClearField("nonce")
        header.ClearField("descriptor")
        flat = self.job.buffer
        checksum = peer.checksum
        stage = self.job.stage
        itemsize = self.itemsize
        for item in self.plan.sends:
            if item.after > self.received.value:
                await self.received.wait_for(item.after)
            message = self.outgoing.pop(item.from_recv, None)
            if message is None:
                # Read from this rank's own data (or a finished segment).
                if stage is not None:
                    await stage.ready(item.lo, item.hi)
                payload = _bytes_view(flat[item.lo : item.hi])
                header.step = item.step
                header.chunk_index = item.chunk
                header.offset = item.lo
                if checksum is not None:
                    header.checksum = checksum(payload)
                    header.has_checksum = True
                message = wire.encode(header, payload)
            await self._write(stream, message, item.step)
            peer.stats.bytes_sent += (item.hi - item.lo) * itemsize
        # End the stream only once everything this rank receives has arrived
        # and passed its checks: the right neighbour's collective then cannot
        # finish before this rank's has all its data. (For a broadcast this
        # is what makes the root's call return only when the last rank has
        # the data.)
        if self.received.value < len(self.plan.recvs):
            await self.received.wait_for(len(self.plan.recvs))
        await self._waiting(
            "send", self.right, "the end of the stream to be read by", stream.close()
        )
        self.out = None

    # ----------------------------------------------------------- receiving

    async def _read(self, stream: InStream, what: str) -> bytes | None:
        return await self._waiting("recv", self.left, f"{what} from", stream.read())

    async def _receive(self) -> None:
        peer = self.peer
        job = self.job
        key = (peer.group, job.seq, self.lane, self.left)
        mailbox = peer.mailbox(key)
        try:
            # A late neighbour (rank-local work before the collective) is
            # waited for as long as it answers pings.
            header, stream = await self._waiting(
                "recv",
                self.left,
                f"{job.name}#{job.seq} to start at",
                asyncio.shield(mailbox.arrived),
            )
            mismatch = describe_mismatch(job.descriptor, header.descriptor, peer.rank, self.left)
            if mismatch:
                raise self._error(ProtocolError, mismatch, self.left)
            await self._consume(stream)
        except BaseException as exc:
            if not mailbox.done.done():
                # Fail the left neighbour's stream with the real cause.
                mailbox.done.set_exception(self._cause(exc))
                mailbox.done.exception()  # mark retrieved
            raise
        else:
            if not mailbox.done.done():
                mailbox.done.set_result(None)
        finally:
            peer.drop_mailbox(key)

    def _reduced_message(
        self,
        index: int,
        incoming: torch.Tensor | None,
        reduce: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object],
    ) -> bytes:
        """The message forwarding receive item ``index``: this rank's range
        reduced with ``incoming``, written in place into the message."""
        send = self.forwards[index]
        header = self._header()
        header.step = send.step
        header.chunk_index = send.chunk
        header.offset = send.lo
        checksum = self.peer.checksum
        if checksum is not None:
            header.has_checksum = True
            header.checksum = 0xFFFFFFFF  # the longest encoding, for the bound
        frame = wire.Frame(header, (send.hi - send.lo) * self.itemsize)
        local = self.job.buffer[send.lo : send.hi]
        if incoming is not None:
            reduce(local, incoming, frame.payload(local.dtype))
        if checksum is not None:
            header.checksum = checksum(frame.view())
        return frame.seal(header)

    async def _consume(self, stream: InStream) -> None:
        peer = self.peer
        job = self.job
        flat = job.buffer
        dtype = flat.dtype
        itemsize = self.itemsize
        reduce = _REDUCERS[job.op]
        mean = job.op is ReduceOp.MEAN
        stage = job.stage
        checksum = peer.checksum
        for index, item in enumerate(self.plan.recvs):
            message = await self._read(stream, f"chunk {item.chunk} of step {item.step}")
            if message is None:
                err = self._error(
                    PeerError,
                    f"rank {self.left} ({peer.address_of(self.left)}) ended its stream after "
                    f"{index} of {len(self.plan.recvs)} chunks; it failed or exited",
                    self.left,
                )
                # If it is alive and failed for a reason, its report may follow.
                err.echo = True
                raise err
            try:
                header, payload = wire.decode(message)
            except ProtocolError as exc:
                raise self._error(
                    ProtocolError, f"from rank {self.left}: {exc.message}", self.left
                ) from exc
            if header.HasField("abort"):
                raise peer.error_from_abort(header.abort)
            nbytes = (item.hi - item.lo) * itemsize
            # The stream is the left neighbour's (checked on its first
            # message), and chunks arrive in plan order; step and src_rank
            # name the rank that produced a forwarded chunk, not the hop.
            if (
                header.seq != job.seq
                or header.chunk_index != item.chunk
                or header.offset != item.lo
                or header.lane != self.lane
                or payload.nbytes != nbytes
            ):
                raise self._error(
                    ProtocolError,
                    f"rank {self.left} sent chunk (seq={header.seq} chunk={header.chunk_index} "
                    f"offset={header.offset} lane={header.lane} bytes={payload.nbytes}, made by "
                    f"rank {header.src_rank} at step {header.step}), expected (seq={job.seq} "
                    f"chunk={item.chunk} offset={item.lo} lane={self.lane} bytes={nbytes}) "
                    f"at step {item.step}",
                    self.left,
                )
            if checksum is not None and (
                not header.has_checksum or checksum(payload) != header.checksum
            ):
                name = integrity.checksum_name(checksum)
                raise self._error(
                    ProtocolError,
                    f"chunk {item.chunk} of step {item.step} from rank {self.left} "
                    f"({peer.address_of(self.left)}) failed its {name} check: corrupted in "
                    "flight; it was discarded",
                    self.left,
                )
            if stage is not None:
                await stage.ready(item.lo, item.hi)
            incoming = torch.frombuffer(payload, dtype=dtype) if nbytes else None
            # No backpressure from our own sender here: waiting for it while
            # it waits for the right neighbour's receiver would close a cycle
            # around the ring.
            hold = index in self.forwards and len(self.outgoing) < self.hold_limit
            if item.action == COPY:
                if incoming is not None:
                    flat[item.lo : item.hi].copy_(incoming)
                if hold:
                    self.outgoing[index] = message
            elif item.action == REDUCE and (hold or not self.in_place):
                # A partial sum is only ever forwarded. Out of place there is
                # nowhere else to keep it, so it is held whatever hold_limit
                # says: usually one segment (1/world of the tensor), at worst
                # the world - 2 segments still to forward, if the right
                # neighbour stalls while the left keeps sending.
                self.outgoing[index] = self._reduced_message(index, incoming, reduce)
            elif item.action == REDUCE:
                if incoming is not None:
                    target = flat[item.lo : item.hi]
                    reduce(target, incoming, target)
            elif incoming is not None:  # REDUCE_LAST: the finished segment
                if self.in_place:
                    target = flat[item.lo : item.hi]
                else:
                    assert job.out is not None
                    target = job.out[item.lo - job.out_offset : item.hi - job.out_offset]
                reduce(flat[item.lo : item.hi], incoming, target)
                if mean:
                    target.div_(self.world)
            if stage is not None and item.action != REDUCE:
                stage.final(item.lo, item.hi)
            peer.stats.bytes_received += nbytes
            self.received.advance()
        tail = await self._read(stream, "the end of the stream")
        if tail is not None:
            tail_header, _ = wire.decode(tail)
            if tail_header.HasField("abort"):
                raise peer.error_from_abort(tail_header.abort)
            raise self._error(
                ProtocolError,
                f"rank {self.left} sent more chunks than the schedule allows "
                f"({len(self.plan.recvs)})",
                self.left,
            )


def _silence_readonly_warning() -> None:
    # Received payloads are read-only bytes; torch warns (once per process)
    # that a tensor over them could be written. We only ever read them, so
    # spend the one warning here, silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(b"\0\0\0\0", dtype=torch.uint8)


_silence_readonly_warning()


def _bytes_view(data: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous 1-D CPU tensor (valid while the
    tensor lives; it is consumed at once by the encoder's single copy)."""
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")


def build_plans(job: Job, rank: int, world: int, policy_lanes: int, root: int) -> list[LanePlan]:
    """The per-lane plans of ``job`` on ``rank``."""
    desc = job.descriptor
    layout_world = 1 if desc.kind == pb.BROADCAST else world
    layout = schedule.Layout.build(desc.numel, layout_world, policy_lanes, desc.chunk_elems)
    if desc.kind == pb.BROADCAST:
        return [
            schedule.broadcast_plan(layout, lane, rank, root, world) for lane in range(policy_lanes)
        ]
    if desc.kind in (pb.ALL_REDUCE, pb.BARRIER):
        steps = schedule.all_reduce_steps(rank, world)
    elif desc.kind == pb.REDUCE_SCATTER:
        steps = schedule.reduce_scatter_steps(rank, world)
    else:
        steps = schedule.all_gather_steps(rank, world)
    return [schedule.ring_plan(layout, lane, steps) for lane in range(policy_lanes)]
