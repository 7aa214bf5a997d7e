"""The lane driver: runs one lane of a ring or chain plan over a transport.

For each lane a rank runs two tasks. The sender streams the plan's send items
to the right neighbour, each as soon as the receive item it forwards has been
applied. The receiver reads the left neighbour's stream, checks every header
against the plan, verifies the checksum, and reduces or copies the payload
into place. Both sides start with a descriptor message, which the receiver
compares with its own view of the collective: any difference is a
ProtocolError naming both ranks and both values.

A lane gets what it needs in a
:class:`~ferrogrpc.algorithms.context.RankContext`, never the peer: it can
run on a :class:`~ferrogrpc.transport.streams.MemoryTransport` with nothing
else.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence

import torch

from ..counter import Counter
from ..errors import Evidence, FerroGrpcError, PeerError, ProtocolError
from ..failure.watchdog import Watchdog
from ..observe import logs
from ..ops import ReduceOp
from ..transport import integrity, planes, wire
from ..transport.streams import InStream, OutStream
from ..transport.wire import bytes_view
from ..v1 import collective_pb2 as pb
from .context import RankContext
from .descriptor import describe_mismatch
from .jobs import Job
from .reducers import REDUCERS, Reducer
from .schedule import COPY, REDUCE, LanePlan, SendItem

# Forwarded messages a lane may hold ready for its sender (see LaneRunner):
# at most this many, and at most this many bytes (but one message at least).
HELD_MESSAGES = 3
HELD_BYTES = 8 << 20

# How long a failing rank tries to hand its right neighbour the cause in band.
ABORT_WRITE_S = 0.5

# [Note: end markers]
# A ring collective succeeds on a rank only if every rank received all its
# data: no rank may return a result while another fails for want of it (a
# corrupted last chunk, a sender that died after its last send). After its
# last chunk each rank sends end markers 1..M (M = world - 1) down its
# stream: marker 1 once it has received and checked everything, marker k
# once it has also read marker k - 1 from its left. So marker k from the
# left says the k ranks upstream have everything, and marker M says it of
# every other rank: a rank finishes once it has read marker M and written
# its own. The markers chain only leftwards, so they cannot deadlock. The
# stream's end then goes in the background (OutStream.end): nothing waits
# for the right neighbour's answer, a round trip that used to end every
# ring collective (one on a long link costs its whole RTT: 50 ms a
# collective at 50 ms). The cost is M - 1 tiny messages' hops on top of the
# last chunk's, one per rank at a time (none in a world of 2);
# docs/benchmarks-history.md, "End markers".


class LaneRunner:
    """Runs one lane of one collective on one rank."""

    def __init__(
        self,
        ctx: RankContext,
        job: Job,
        lane: int,
        plan: LanePlan,
        members: Sequence[int] | None = None,
    ) -> None:
        """``members``: the ranks of the ring or chain, in order (default:
        every rank); ``plan`` is this rank's, at its place among them."""
        self.ctx = ctx
        self.job = job
        self.lane = lane
        self.plan = plan
        me = ctx.identity
        ring = list(members) if members is not None else list(range(me.world_size))
        self.world = len(ring)
        place = ring.index(me.rank)
        self.right = ring[(place + 1) % self.world]
        self.left = ring[(place - 1) % self.world]
        self.itemsize = job.buffer.element_size()
        # Chunks travel as job.wire (a narrower float) when set; every hop
        # still reduces in the buffer's dtype.
        self.wire = job.wire
        self.wire_itemsize = job.wire.itemsize if job.wire is not None else self.itemsize
        self.received = Counter()
        # End markers read from the left neighbour (see _send and _consume).
        self.ends = Counter()
        self.ends_needed = max(1, self.world - 1)
        # Messages ready to forward, by receive index: a received chunk that is
        # copied travels on unchanged (its header names where it came from
        # and carries its verified checksum); a partial sum is reduced
        # straight into the message that carries it on. That saves the copy
        # into a new message at send time, but holds the message until the
        # sender gets to it; so only while the sender keeps up (at most
        # hold_limit waiting: HELD_MESSAGES, fewer where that would exceed
        # HELD_BYTES). Beyond that, results go to the tensor and the sender
        # frames them from there, as for its own data.
        self.outgoing: dict[int, tuple[bytes, int]] = {}
        largest = max((item.hi - item.lo for item in plan.recvs), default=0) * self.wire_itemsize
        self.hold_limit = min(HELD_MESSAGES, max(1, HELD_BYTES // max(largest, 1)))
        # For each receive index that is forwarded, the send item forwarding it.
        self.forwards = {item.from_recv: item for item in plan.sends if item.from_recv >= 0}
        self.in_place = job.out is None
        # With a wire dtype: received values widened, and values rounded.
        self._wide = wire.Scratch(job.buffer.dtype)
        self._narrow = wire.Scratch(job.wire or job.buffer.dtype)
        # Float32 chunks may travel packed (planes.py): where the link to
        # the right is slower than packing (its gauge says so), or always
        # or never as the context says. Packed chunks from the left are
        # unpacked into _unpacked.
        self.packable = job.buffer.dtype == torch.float32 and job.wire is None
        self.gauge = ctx.gauge(self.right)
        self._unpacked = wire.Scratch(torch.float32)
        self._sums = wire.Scratch(torch.float32)
        # The outgoing stream, until it has been closed cleanly; and the
        # write of its descriptor while it runs (see _send).
        self.out: OutStream | None = None
        self._described: asyncio.Future[None] | None = None
        self.watch = Watchdog(me, ctx.transport, ctx.timeouts.idle, job.name, job.seq)

    def _error(self, cls: type[FerroGrpcError], message: str, peer: int | None) -> FerroGrpcError:
        return self.ctx.identity.error(cls, message, op=self.job.name, seq=self.job.seq, peer=peer)

    def _cause(self, exc: BaseException) -> FerroGrpcError:
        return self.ctx.failure.cause(exc, self.job.name, self.job.seq, self.watch.first_failure)

    async def run(self) -> None:
        try:
            await self.watch.guard(self._send(), self._receive())
        except BaseException as exc:
            found = self._cause(exc)
            if (
                isinstance(found, ProtocolError)
                and found.evidence is Evidence.FOUND
                and found.seq == self.job.seq
            ):
                # Rule 2 at once: this rank's own finding in this job's data
                # breaks it before the abort below can travel round and
                # come back relayed (which would then be the cause on
                # record, and the finding only what it raised).
                self.ctx.failure.declare(found, broadcast=True)
            await self._abort_downstream(exc)
            raise

    async def _abort_downstream(self, exc: BaseException) -> None:
        """Tell the right neighbour why, in band, before the stream ends: so it
        reports the root cause instead of "the stream ended"."""
        stream, self.out = self.out, None
        described, self._described = self._described, None
        if stream is None:
            return
        header = self._header()
        header.abort.CopyFrom(self.ctx.failure.abort_message(self._cause(exc)))
        try:
            async with asyncio.timeout(ABORT_WRITE_S):
                if described is not None:
                    # Its write finishes first: cancelled, gRPC would cancel
                    # the whole call, and the abort with it.
                    await asyncio.wait([described])
                await stream.write(wire.encode(header))
                await stream.close()
        except (Exception, asyncio.CancelledError):
            # Best effort. A CancelledError here is the TaskGroup's own request
            # to stop this task, still pending from the failure being handled;
            # the caller re-raises that failure (or the cancellation) next.
            pass
        finally:
            stream.cancel()
            if described is not None:
                if not described.done():
                    described.cancel()
                elif not described.cancelled():
                    described.exception()  # (retrieved: its failure is this one's aftermath)

    # ------------------------------------------------------------- sending

    def _header(self) -> pb.ChunkHeader:
        return pb.ChunkHeader(
            group=self.ctx.group,
            seq=self.job.seq,
            kind=self.job.kind,  # type: ignore[arg-type]
            src_rank=self.ctx.identity.rank,
            lane=self.lane,
        )

    async def _write(self, stream: OutStream, message: bytes, step: int) -> None:
        await self.watch.wait(
            "send", self.right, f"step {step} to be accepted by", stream.write(message)
        )

    async def _send(self) -> None:
        ctx = self.ctx
        stream = await ctx.transport.open(self.right, self.lane)
        self.out = stream
        opening = self._header()
        opening.descriptor.CopyFrom(self.job.descriptor)
        opening.nonce = ctx.nonce
        # The descriptor opens the stream, in the same message as the first
        # chunk where that chunk is this rank's own data, ready now (see
        # [Note: the opening message] in intake.py); else on its own, the
        # chunks after it. gRPC reports a write done only once its own
        # threads have passed it back (0.3-4 ms on this 2-core machine), and
        # takes one write at a time: so the next chunk is framed while the
        # opening's write completes, not after.
        first = self._opening_chunk(opening)
        sent = 0 if first is None else 1
        described = asyncio.ensure_future(
            self._write(stream, wire.encode(opening) if first is None else first[0], 0)
        )
        carried = 0 if first is None else first[1]
        del first  # (gRPC copies it; the first chunk is not held for the whole collective)
        self._described = described
        # A failed opening fails the sender at once, even while it waits
        # for a chunk to forward.
        described.add_done_callback(functools.partial(self._on_described, carried))
        await asyncio.sleep(0)  # (the opening's write starts)
        await self._send_chunks(stream, described, sent)
        await described
        self._described = None
        # End the stream with end markers, the first only once everything
        # this rank receives has arrived and passed its checks, and marker k
        # once marker k - 1 came from the left. The markers, not the
        # transport's end of stream, are the proof: gRPC can report a
        # cancelled stream to its reader as a clean end. A rank finishes
        # only after reading world - 1 markers (every other rank has
        # everything): so it never finishes a collective any rank failed for
        # want of data. (For a broadcast, the root's call returns only when
        # the last rank has the data.) See [Note: end markers].
        if self.received.value < len(self.plan.recvs):
            await self.received.wait_for(len(self.plan.recvs))
        end = self._header()
        for k in range(1, self.ends_needed + 1):
            if self.ends.value < k - 1:
                await self.ends.wait_for(k - 1)
            end.end = k
            await self._write(stream, wire.encode(end), len(self.plan.sends))
        self.out = None
        stream.end()

    def _on_described(self, carried: int, described: asyncio.Future[None]) -> None:
        error = None if described.cancelled() else described.exception()
        if error is not None:
            self.received.fail(error)
        elif carried:  # the opening's chunk is sent once its write is done
            self.ctx.stats.sent(self.right, carried)

    def _opening_chunk(self, opening: pb.ChunkHeader) -> tuple[bytes, int] | None:
        """The plan's first chunk framed with ``opening`` (the descriptor
        and this rank's credential) in its header, if it is this rank's own
        data and ready now; else None."""
        if not self.plan.sends or self.job.stage is not None:
            return None
        item = self.plan.sends[0]
        if item.after > 0 or item.from_recv >= 0 or item.hi <= item.lo:
            # (An empty chunk stays a message of its own: an opening carries
            # a chunk exactly when it carries a payload.)
            return None
        return self._own_message(opening, item)

    def _own_message(self, header: pb.ChunkHeader, item: SendItem) -> tuple[bytes, int]:
        """The message carrying ``item`` from this rank's buffer, and its
        payload's size."""
        data = self.job.buffer[item.lo : item.hi]
        header.step = item.step
        header.chunk_index = item.chunk
        header.offset = item.lo
        header.packed_top = 0
        if self.wire is not None:
            # An all-gather's own block: as every other rank gets it.
            return self._narrowed_message(header, data, self.job.kind == pb.ALL_GATHER)
        if self._packs(data.numel()):
            packed = self._packed_message(header, data)
            if packed is not None:
                return packed
        payload = bytes_view(data)
        checksum = self.ctx.checksum
        if checksum is not None:
            header.checksum = checksum(payload)
            header.has_checksum = True
        return wire.encode(header, payload), payload.nbytes

    def _packs(self, numel: int) -> bool:
        """Whether a chunk of ``numel`` elements goes packed now."""
        if not self.packable or numel < planes.MIN_ELEMS:
            return False
        gauge = self.gauge
        switches = gauge.switches
        packing = gauge.packs()
        if gauge.switches != switches:
            self._log_packing(gauge, first=switches == 0)
        return packing

    def _log_packing(self, gauge: planes.LinkGauge, first: bool) -> None:
        """Say that this link's chunks start or stop travelling packed: at
        INFO the first time, at DEBUG after (a link near the gauge's
        threshold may switch back and forth)."""
        if gauge.mode != "auto":
            why = f"FERROGRPC_PACK={gauge.mode}"
        else:
            why = (
                f"its chunk writes run at {gauge.link_rate() / 1e6:.0f} MB/s, this rank "
                f"packs {planes.packing_rate() / 1e6:.0f} MB/s"
            )
        state = "packed" if gauge.packing else "unpacked"
        logs.for_rank(self.ctx.identity).log(
            logging.INFO if first else logging.DEBUG,
            "float32 chunks to rank %d (%s) now travel %s: %s",
            self.right,
            self.ctx.identity.address_of(self.right),
            state,
            why,
            extra={"op": self.job.name, "seq": self.job.seq, "peer": self.right},
        )

    def _packed_message(
        self, header: pb.ChunkHeader, data: torch.Tensor
    ) -> tuple[bytes, int] | None:
        """The message carrying the float32 ``data`` packed (planes.py), if
        packing makes it smaller; else None. (The caller asked _packs.)"""
        n = data.numel()
        began = time.perf_counter()
        top = planes.top_plane(data)
        if len(top) >= n:
            return None
        header.packed_top = len(top)
        nbytes = len(top) + 3 * n
        frame = self._frame(header, nbytes)
        payload = frame.payload(torch.uint8)
        payload[: len(top)].copy_(torch.frombuffer(top, dtype=torch.uint8))
        planes.write_low(data, payload[len(top) :])
        del payload  # (not used past the seal)
        planes.saw_packing(n, time.perf_counter() - began)
        return self._seal(header, frame), nbytes

    async def _send_chunks(
        self, stream: OutStream, described: asyncio.Future[None], sent: int
    ) -> None:
        """Send the plan's chunks after the first ``sent`` (the opening
        message carried those), the first once ``described`` (the opening's
        write) is done."""
        header = self._header()
        stage = self.job.stage
        stats = self.ctx.stats
        for item in self.plan.sends[sent:]:
            if item.after > self.received.value:
                await self.received.wait_for(item.after)
            held = self.outgoing.pop(item.from_recv, None)
            if held is None:
                # Read from this rank's own data (or a finished segment).
                if stage is not None:
                    await stage.ready(item.lo, item.hi)
                held = self._own_message(header, item)
            message, nbytes = held
            del held
            if not described.done():
                await described
            began = time.perf_counter()
            await self._write(stream, message, item.step)
            self.gauge.wrote(len(message), time.perf_counter() - began)
            stats.sent(self.right, nbytes)

    def _narrowed_message(
        self, header: pb.ChunkHeader, data: torch.Tensor, round_: bool
    ) -> tuple[bytes, int]:
        """The message carrying ``data`` (in the buffer's dtype) in the wire
        dtype: converted straight into the message, with no converted copy
        in between; with ``round_``, ``data`` is rounded to it too."""
        assert self.wire is not None
        nbytes = data.numel() * self.wire_itemsize
        frame = self._frame(header, nbytes)
        narrow = frame.payload(self.wire)
        narrow.copy_(data)
        if round_:
            data.copy_(narrow)
        return self._seal(header, frame), nbytes

    def _wide_or(self, incoming: torch.Tensor) -> torch.Tensor:
        """Received values to reduce: wire-dtype ones widened first, in one
        conversion pass (torch's CPU kernels reduce a float32 with a
        bfloat16 operand six times slower than two float32s)."""
        return incoming if self.wire is None else self._wide.filled(incoming)

    # ----------------------------------------------------------- receiving

    async def _read(self, stream: InStream, what: str) -> bytes | None:
        return await self.watch.wait("recv", self.left, f"{what} from", stream.read())

    async def _receive(self) -> None:
        ctx = self.ctx
        job = self.job
        key = (ctx.group, job.seq, self.lane, self.left)
        mailbox = ctx.mailboxes.get(key)
        try:
            # A late neighbour (rank-local work before the collective) is
            # waited for as long as it answers pings.
            header, stream = await self.watch.wait(
                "recv",
                self.left,
                f"{job.name}#{job.seq} to start at",
                asyncio.shield(mailbox.arrived),
            )
            mismatch = describe_mismatch(
                job.descriptor, header.descriptor, ctx.identity.rank, self.left
            )
            if mismatch:
                raise self._error(ProtocolError, mismatch, self.left)
            if isinstance(stream, memoryview):
                raise self._error(
                    ProtocolError,
                    f"rank {self.left} sent {job.name}#{job.seq} as a small collective, this "
                    "rank runs it as a ring",
                    self.left,
                )
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
            ctx.mailboxes.drop(key)

    def _reduced_message(
        self, index: int, incoming: torch.Tensor | None, reduce: Reducer
    ) -> tuple[bytes, int]:
        """The message forwarding receive item ``index``: this rank's range
        reduced with ``incoming``, written in place into the message (or
        packed from a scratch sum, where this lane packs)."""
        send = self.forwards[index]
        header = self._forward_header(index)
        local = self.job.buffer[send.lo : send.hi]
        partial = None
        if incoming is not None and self._packs(incoming.numel()):
            partial = self._sums.empty(incoming.numel())
            reduce(local, incoming, partial)
            packed = self._packed_message(header, partial)
            if packed is not None:
                return packed
        nbytes = (send.hi - send.lo) * self.wire_itemsize
        frame = self._frame(header, nbytes)
        if partial is not None:  # (reduced, but it does not pack smaller)
            frame.payload(local.dtype).copy_(partial)
        elif incoming is not None:
            if self.wire is None:
                reduce(local, incoming, frame.payload(local.dtype))
            else:
                # Reduced in the buffer's dtype, rounded once for the wire.
                partial = self._wide_or(incoming)
                reduce(local, partial, partial)
                frame.payload(self.wire).copy_(partial)
        return self._seal(header, frame), nbytes

    def _forward_header(self, index: int) -> pb.ChunkHeader:
        """The header of the message that forwards receive item ``index``."""
        send = self.forwards[index]
        header = self._header()
        header.step = send.step
        header.chunk_index = send.chunk
        header.offset = send.lo
        return header

    def _frame(self, header: pb.ChunkHeader, nbytes: int) -> wire.Frame:
        """A frame for a payload of ``nbytes`` under ``header`` (with room
        for its checksum, which :meth:`_seal` sets)."""
        if self.ctx.checksum is not None:
            header.has_checksum = True
            header.checksum = 0xFFFFFFFF  # the longest encoding, for the bound
        return wire.Frame(header, nbytes)

    def _seal(self, header: pb.ChunkHeader, frame: wire.Frame) -> bytes:
        checksum = self.ctx.checksum
        if checksum is not None:
            header.checksum = checksum(frame.view())
        return frame.seal(header)

    def _round(self, target: torch.Tensor, index: int, hold: bool) -> None:
        """Round a finished segment to the wire dtype, as every other rank
        receives it. When the segment is forwarded next, it is rounded
        straight into the message that forwards it (no conversion again at
        send time); else through a scratch buffer."""
        if hold:
            self.outgoing[index] = self._narrowed_message(self._forward_header(index), target, True)
        else:
            target.copy_(self._narrow.filled(target))

    def _check_header(self, header: pb.ChunkHeader, payload: memoryview, index: int) -> None:
        item = self.plan.recvs[index]
        job = self.job
        nbytes = (item.hi - item.lo) * self.wire_itemsize
        if header.packed_top:
            if not self.packable:
                raise self._error(
                    ProtocolError,
                    f"rank {self.left} sent a packed chunk in {job.name}#{job.seq}, which "
                    "travels unpacked (not float32, or in a wire dtype)",
                    self.left,
                )
            nbytes = header.packed_top + 3 * (item.hi - item.lo)
        # The stream is the left neighbour's (checked on its first message),
        # and chunks arrive in plan order; step and src_rank name the rank
        # that produced a forwarded chunk, not the hop.
        if (
            header.seq != job.seq
            or header.chunk_index != item.chunk
            or header.offset != item.lo
            or header.lane != self.lane
            or payload.nbytes != nbytes
            or header.end != 0
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
        checksum = self.ctx.checksum
        if checksum is not None and (
            not header.has_checksum or checksum(payload) != header.checksum
        ):
            raise self._error(
                ProtocolError,
                f"chunk {item.chunk} of step {item.step} from rank {self.left} "
                f"({self.ctx.identity.address_of(self.left)}) failed its "
                f"{integrity.checksum_name(checksum)} check: corrupted in flight; it was discarded",
                self.left,
            )

    def _ended_early(self, index: int) -> FerroGrpcError:
        total = len(self.plan.recvs)
        what = (
            f"after all {total} chunks but without its end markers (it, or a rank before "
            "it, did not receive everything)"
            if index == total
            else f"after {index} of {total} chunks"
        )
        return self.ctx.identity.error(
            PeerError,
            f"rank {self.left} ({self.ctx.identity.address_of(self.left)}) ended its stream "
            f"{what}; it failed or exited",
            op=self.job.name,
            seq=self.job.seq,
            peer=self.left,
            # If it is alive and failed for a reason, its report may follow.
            evidence=Evidence.SYMPTOM,
        )

    def _unpack(self, payload: memoryview, top: int, numel: int) -> torch.Tensor:
        """A packed chunk's float32 elements (in a scratch buffer)."""
        out = self._unpacked.empty(numel)
        try:
            planes.unpack(payload, top, out)
        except ValueError as exc:
            raise self._error(
                ProtocolError,
                f"rank {self.left} sent a packed chunk that does not unpack ({exc}); it was "
                "discarded",
                self.left,
            ) from exc
        return out

    def _decode(self, message: bytes) -> tuple[pb.ChunkHeader, memoryview]:
        try:
            header, payload = wire.decode(message)
        except ProtocolError as exc:
            raise self._error(
                ProtocolError, f"from rank {self.left}: {exc.message}", self.left
            ) from exc
        if header.HasField("abort"):
            raise self.ctx.failure.from_report(header.abort)
        return header, payload

    async def _consume(self, stream: InStream) -> None:
        ctx = self.ctx
        job = self.job
        flat = job.buffer
        dtype = flat.dtype
        wire_dtype = self.wire if self.wire is not None else dtype
        reduce = REDUCERS[job.op]
        mean = job.op is ReduceOp.MEAN
        stage = job.stage
        stats = ctx.stats
        for index, item in enumerate(self.plan.recvs):
            message = await self._read(stream, f"chunk {item.chunk} of step {item.step}")
            if message is None:
                raise self._ended_early(index)
            header, payload = self._decode(message)
            self._check_header(header, payload, index)
            nbytes = payload.nbytes
            if stage is not None:
                await stage.ready(item.lo, item.hi)
            # In the wire dtype, if any: a copy below converts it as it goes;
            # a reduction widens it first (_wide_or).
            incoming: torch.Tensor | None
            if header.packed_top:
                incoming = self._unpack(payload, header.packed_top, item.hi - item.lo)
            else:
                incoming = torch.frombuffer(payload, dtype=wire_dtype) if nbytes else None
            # No backpressure from our own sender here: waiting for it while
            # it waits for the right neighbour's receiver would close a cycle
            # around the ring.
            hold = index in self.forwards and len(self.outgoing) < self.hold_limit
            if item.action == COPY:
                if incoming is not None:
                    flat[item.lo : item.hi].copy_(incoming)
                # (Never the opening as it is: it carries the left's credential.)
                if hold and not (index == 0 and header.HasField("descriptor")):
                    self.outgoing[index] = (message, nbytes)
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
                    reduce(target, self._wide_or(incoming), target)
            elif incoming is not None:  # REDUCE_LAST: the finished segment
                if self.in_place:
                    target = flat[item.lo : item.hi]
                else:
                    assert job.out is not None
                    target = job.out[item.lo - job.out_offset : item.hi - job.out_offset]
                reduce(flat[item.lo : item.hi], self._wide_or(incoming), target)
                if mean:
                    target.div_(self.world)
                if self.wire is not None and self.in_place:
                    # Every other rank receives this segment rounded to the
                    # wire dtype: round it here too, so all hold the same.
                    self._round(target, index, hold)
            if stage is not None and item.action != REDUCE:
                stage.final(item.lo, item.hi)
            stats.received(self.left, nbytes)
            self.received.advance()
        # The left neighbour's end markers (see _send). Without them (a bare
        # end of stream) it failed, even if every chunk this rank needed
        # arrived; succeeding here would let this rank finish a collective
        # its neighbour did not.
        for k in range(1, self.ends_needed + 1):
            tail = await self._read(stream, f"end marker {k}")
            if tail is None:
                raise self._ended_early(len(self.plan.recvs))
            header, payload = self._decode(tail)  # an abort in band raises its report
            if header.end != k or payload.nbytes or header.seq != job.seq:
                raise self._error(
                    ProtocolError,
                    f"rank {self.left} sent a message where end marker {k} belongs, after "
                    f"all {len(self.plan.recvs)} chunks the schedule allows",
                    self.left,
                )
            self.ends.advance()
