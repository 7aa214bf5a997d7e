"""Small collectives in one exchange: every rank sends its data to every
other rank, and each computes the result itself.

Below ``SMALL_BYTES`` (and up to ``SMALL_WORLD`` ranks) a collective's cost
is its latency, not its bytes: a ring needs ``2(n-1)`` steps, each a round of
messages, while one exchange is a single round. For an all-gather and a
reduce-scatter the bound is on one rank's part, not the whole tensor, except
where several hosts hold several ranks each (see :func:`is_small`). A rank
sends one message to each other rank (over the host's shared-memory sockets
to ranks on its host, over its long-lived gRPC link to the others: no new
stream per collective), receives one from each, and reduces the values in
rank order, so every rank computes bitwise the same result. Every message carries the sender's
descriptor, checked as a ring's stream is, and a checksum when it crosses
gRPC.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence

import torch

from . import integrity, schedule, wire
from .context import RankContext
from .descriptor import describe_mismatch
from .errors import FerroGrpcError, Identity, ProtocolError
from .jobs import Job
from .links import Links
from .local import SMALL, LocalPlane, split_small
from .ops import ReduceOp
from .reducers import REDUCERS
from .v1 import collective_pb2 as pb
from .watchdog import Watchdog
from .wire import bytes_view

# A collective of at most this many bytes, on at most this many ranks, runs
# in one exchange.
SMALL_BYTES = 256 << 10
SMALL_WORLD = 16


def is_small(desc: pb.Descriptor, itemsize: int, *, by_part: bool) -> bool:
    """Whether a collective runs in one exchange. With ``by_part``, an
    all-gather or a reduce-scatter is measured by one rank's part (the
    largest, for an uneven reduce-scatter): in one exchange each rank sends
    every other its part, which is what a ring moves too, in a single round
    instead of ``n-1``. Anything else, and those too without ``by_part``, by
    the whole tensor, which each rank sends to every other.

    ``by_part`` is for a group on one host, or with one rank per host:
    where several hosts hold several ranks each, one exchange would send
    every rank's part to every rank on the other hosts, several times the
    cross-host bytes of the two-level path (hierarchy.py)."""
    numel = desc.numel
    if by_part and desc.kind in (pb.ALL_GATHER, pb.REDUCE_SCATTER):
        numel = -(-numel // max(1, desc.world_size))
    return desc.world_size <= SMALL_WORLD and numel * itemsize <= SMALL_BYTES


class SmallRunner:
    """Runs one small collective (see the module docstring)."""

    def __init__(
        self,
        ctx: RankContext,
        links: Links,
        plane: LocalPlane | None,
        local: Sequence[int],
        job: Job,
    ) -> None:
        self.ctx = ctx
        self.links = links
        self.plane = plane
        self.local = set(local) if plane is not None else set()
        self.job = job
        me = ctx.identity
        self.me = me
        self.watch = Watchdog(me, ctx.transport, ctx.timeouts.idle, job.name, job.seq)
        self.desc = job.descriptor.SerializeToString()
        # Messages over gRPC go in parts of at most a chunk.
        self.part = max(1, job.descriptor.chunk_elems) * job.buffer.element_size()
        # A wire dtype applies where bytes cross gRPC: then every rank's
        # contribution is rounded to it, its own and its host's included, so
        # that every rank reduces the same values.
        all_local = plane is not None and len(self.local) == me.world_size
        self.wire = None if all_local else job.wire

    async def run(self) -> None:
        job, ctx = self.job, self.ctx
        try:
            await self.watch.guard_here(self._main())
        except BaseException as exc:
            if self.plane is not None and self.local:
                cause = ctx.failure.cause(exc, job.name, job.seq, self.watch.first_failure)
                # No rounds here: a refusal leaves the plane as it was.
                if not ctx.failure.plane_survives(cause, mid_round=False):
                    self.plane.abort(ctx.failure.abort_message(cause))
            raise

    # ----------------------------------------------------------- messages

    async def _send(self, dst: int, data: torch.Tensor) -> None:
        if self.wire is not None:
            data = data.to(self.wire)
        view = bytes_view(data)
        if dst in self.local:
            assert self.plane is not None
            self.plane.send_small(dst, self.job.seq, self.desc, view)
            return
        ctx, job = self.ctx, self.job
        header = pb.ChunkHeader(group=ctx.group, seq=job.seq, src_rank=self.me.rank)
        header.kind = job.kind  # type: ignore[assignment]
        header.descriptor.CopyFrom(job.descriptor)
        await send_parts(ctx, self.links, self.watch, dst, header, view, self.part)

    def _mismatch(self, src: int, theirs: pb.Descriptor, what: str) -> FerroGrpcError:
        return mismatch(self.me, self.job, src, theirs, what)

    def _sizes(self, src: int, got: int, expected: int) -> FerroGrpcError:
        return wrong_size(self.me, self.job, src, got, expected)

    async def _receive(self, src: int, nbytes: int) -> memoryview:
        job = self.job
        what = f"{job.name}#{job.seq} from"
        if src in self.local:
            assert self.plane is not None
            kind, payload = await self.watch.wait(
                f"r{src}", src, what, self.plane.first(src, job.seq)
            )
            if kind != SMALL:
                raise self._mismatch(
                    src, pb.Descriptor.FromString(payload), "ran it through shared segments"
                )
            desc, data = split_small(payload)
            if desc != self.desc:
                raise self._mismatch(src, pb.Descriptor.FromString(desc), "disagrees")
            if data.nbytes != nbytes:
                raise self._sizes(src, data.nbytes, nbytes)
            self.ctx.stats.bytes_local += data.nbytes
            return data
        ctx = self.ctx
        parts = []
        for part in range(max(1, -(-nbytes // self.part))):
            key = (ctx.group, job.seq, part, src)
            box = ctx.mailboxes.get(key)
            try:
                if box.arrived.done():
                    header, item = box.arrived.result()
                else:
                    header, item = await self.watch.wait(
                        f"r{src}", src, what, asyncio.shield(box.arrived)
                    )
            finally:
                ctx.mailboxes.drop(key)
            if not isinstance(item, memoryview):
                err = self._mismatch(src, header.descriptor, "ran it as a ring")
                if not box.done.done():
                    box.done.set_exception(err)  # fail its stream with the cause
                    box.done.exception()
                raise err
            if header.descriptor != job.descriptor:
                raise self._mismatch(src, header.descriptor, "disagrees")
            size = min(self.part, nbytes - part * self.part)
            if header.offset != nbytes or item.nbytes != max(size, 0):
                raise self._sizes(src, header.offset, nbytes)
            check_part(ctx, self.me, job.name, job.seq, src, header, item)
            parts.append(item)
        data = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
        ctx.stats.bytes_received += data.nbytes
        return data

    async def _exchange(
        self, outgoing: dict[int, torch.Tensor], expect: dict[int, int]
    ) -> dict[int, memoryview]:
        """Send ``outgoing[r]`` to every other rank r and receive ``expect[r]``
        bytes from each; return what each sent. Ranks on this host are sent to
        at once (a socket write); a failed gRPC send fails the exchange at
        once, like a failed receive."""
        got: dict[int, memoryview] = {}
        if not self.local:
            # Every message crosses gRPC: send each, then take each, in this
            # task (tasks cost more than the messages). No send waits on a
            # receive: every rank's intake reads its links as they arrive.
            for dst, data in outgoing.items():
                await self._send(dst, data)
            for src in outgoing:
                got[src] = await self._receive(src, expect[src])
            return got

        async def receive(src: int) -> None:
            got[src] = await self._receive(src, expect[src])

        remote = [dst for dst in outgoing if dst not in self.local]
        for dst in outgoing:
            if dst in self.local:
                await self._send(dst, outgoing[dst])
        async with asyncio.TaskGroup() as tg:
            for dst in remote:
                tg.create_task(self._send(dst, outgoing[dst]))
            for src in outgoing:
                tg.create_task(receive(src))
        return got

    # --------------------------------------------------------- algorithms

    async def _main(self) -> None:
        job, me = self.job, self.me
        buf, stage = job.buffer, job.stage
        if stage is not None:
            await stage.ready(0, buf.numel())
        if job.kind == pb.ALL_TO_ALL:
            await self._all_to_all([r for r in range(me.world_size) if r != me.rank], buf.dtype)
            return
        outgoing, expect = plan(job, me.rank, me.world_size, self.wire)
        got = await self._exchange(outgoing, expect)
        done = finish(job, me.rank, me.world_size, got, self.wire)
        if stage is not None:
            stage.final(*done)

    async def _all_to_all(self, others: list[int], dtype: torch.dtype) -> None:
        job, rank = self.job, self.me.rank
        assert job.out is not None and job.splits is not None
        ins, outs = job.splits
        at_in = [sum(ins[:r]) for r in range(len(ins))]
        at_out = [sum(outs[:r]) for r in range(len(outs))]
        buf, out = job.buffer, job.out
        got = await self._exchange(
            {r: buf[at_in[r] : at_in[r] + ins[r]] for r in others},
            {r: outs[r] * dtype.itemsize for r in others},
        )
        out[at_out[rank] : at_out[rank] + outs[rank]].copy_(
            buf[at_in[rank] : at_in[rank] + ins[rank]]
        )
        for r, data in got.items():
            out[at_out[r] : at_out[r] + outs[r]].copy_(_tensor(data, dtype, out.dtype))


def mismatch(me: Identity, job: Job, src: int, theirs: pb.Descriptor, what: str) -> FerroGrpcError:
    """The ProtocolError for rank ``src``'s message of ``job``: the first
    descriptor field it disagrees on, else ``what`` it did."""
    found = describe_mismatch(job.descriptor, theirs, me.rank, src)
    return me.error(
        ProtocolError, found or f"rank {src} {what}", op=job.name, seq=job.seq, peer=src
    )


def wrong_size(me: Identity, job: Job, src: int, got: int, expected: int) -> FerroGrpcError:
    """The ProtocolError for a message of ``got`` bytes where ``expected`` were."""
    what = f"sent {got} bytes for {job.name}#{job.seq}; this rank expected {expected}"
    return mismatch(me, job, src, job.descriptor, what)


def plan(
    job: Job, rank: int, world: int, wire: torch.dtype | None
) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """What a small collective sends each other rank, and how many bytes it
    expects from each (in ``wire``'s dtype where given)."""
    buf, kind = job.buffer, job.kind
    n = buf.numel()
    item = (wire or buf.dtype).itemsize
    others = [r for r in range(world) if r != rank]
    if kind in (pb.ALL_REDUCE, pb.BARRIER):
        return dict.fromkeys(others, buf), dict.fromkeys(others, n * item)
    if kind == pb.BROADCAST:
        root = job.descriptor.root
        outgoing = {r: buf if rank == root else buf[:0] for r in others}
        return outgoing, {r: n * item if r == root else 0 for r in others}
    if kind == pb.ALL_GATHER:
        m = n // world
        own = buf[rank * m : (rank + 1) * m]
        return dict.fromkeys(others, own), dict.fromkeys(others, m * item)
    if kind == pb.REDUCE_SCATTER:
        bounds = schedule.split_bounds(0, n, world)
        lo, hi = bounds[rank]
        return {r: buf[bounds[r][0] : bounds[r][1]] for r in others}, dict.fromkeys(
            others, (hi - lo) * item
        )
    raise AssertionError(f"not a small collective: kind {kind}")


def finish(
    job: Job, rank: int, world: int, got: dict[int, memoryview], wire: torch.dtype | None
) -> tuple[int, int]:
    """Compute a small collective's result from what every other rank sent
    (see :func:`plan`); return the element range of ``job.buffer`` it
    produced (or that ``job.out`` holds)."""
    buf, kind = job.buffer, job.kind
    n = buf.numel()
    dtype = wire or buf.dtype
    # With a wire dtype every rank's contribution, its own included, is
    # rounded to it, so that every rank reduces the same values.
    mine = buf if wire is None else buf.to(wire).to(buf.dtype)
    if kind == pb.ALL_REDUCE:
        if wire is None and _reduce_tiny(buf, rank, world, got, job.op):
            return 0, n
        values = [mine if r == rank else _tensor(got[r], dtype, buf.dtype) for r in range(world)]
        _reduce_into(buf, values, job.op, world)
    elif kind == pb.BROADCAST:
        root = job.descriptor.root
        if rank != root:
            buf.copy_(_tensor(got[root], dtype, buf.dtype))
    elif kind == pb.ALL_GATHER:
        m = n // world
        if wire is not None:
            own = buf[rank * m : (rank + 1) * m]
            own.copy_(own.to(wire))  # as every other rank gets it
        for r, data in got.items():
            buf[r * m : (r + 1) * m].copy_(_tensor(data, dtype, buf.dtype))
    elif kind == pb.REDUCE_SCATTER:
        assert job.out is not None
        lo, hi = schedule.split_bounds(0, n, world)[rank]
        values = [
            mine[lo:hi] if r == rank else _tensor(got[r], dtype, buf.dtype) for r in range(world)
        ]
        job.out.copy_(_reduce(values, job.op, world))
        return lo, hi
    return 0, n


async def send_parts(
    ctx: RankContext,
    links: Links,
    watch: Watchdog,
    dst: int,
    header: pb.ChunkHeader,
    view: memoryview,
    part: int,
) -> None:
    """Send ``view`` to ``dst`` on its link, in parts of at most ``part``
    bytes: each with ``header`` (its lane the part's index, its offset the
    whole message's size) and, when enabled, the part's checksum."""
    total = view.nbytes
    header.offset = total
    for index, lo in enumerate(range(0, max(total, 1), part)):
        piece = view[lo : lo + part]
        header.lane = index
        if ctx.checksum is not None:
            header.checksum = ctx.checksum(piece)
            header.has_checksum = True
        await watch.wait(
            f"s{dst}",
            dst,
            "a message to be accepted by",
            links.send(dst, wire.encode(header, piece)),
        )
    ctx.stats.bytes_sent += total


def check_part(
    ctx: RankContext,
    me: Identity,
    op: str,
    seq: int,
    src: int,
    header: pb.ChunkHeader,
    item: memoryview,
) -> None:
    """Raise ProtocolError naming ``src`` if a received part fails its checksum."""
    checksum = ctx.checksum
    if checksum is not None and (not header.has_checksum or checksum(item) != header.checksum):
        raise me.error(
            ProtocolError,
            f"the message from rank {src} ({me.address_of(src)}) failed its "
            f"{integrity.checksum_name(checksum)} check: corrupted in flight; it was discarded",
            op=op,
            seq=seq,
            peer=src,
        )


def _tensor(data: memoryview, dtype: torch.dtype, into: torch.dtype) -> torch.Tensor:
    """Received bytes of ``dtype``, as ``into``."""
    if not data.nbytes:
        return torch.empty(0, dtype=into)
    t = torch.frombuffer(data, dtype=dtype)
    return t if dtype == into else t.to(into)


# A sum (or mean) of at most this many float32 or float64 elements is
# computed in Python rather than by torch ops: the same bits (below), at a
# fraction of the cost of torch's dispatch for one element (its reduction
# was a third of a 4 B all_reduce's CPU time on one host).
TINY_ELEMS = 16
_TINY_CODES = {torch.float32: "f", torch.float64: "d"}
_tiny_structs: dict[tuple[str, int], struct.Struct] = {}


def _reduce_tiny(
    buf: torch.Tensor, rank: int, world: int, got: dict[int, memoryview], op: ReduceOp
) -> bool:
    """Sum (or average) a tiny float tensor's values in rank order, in
    Python, into ``buf``; False (``buf`` untouched) where torch must do it.

    Python adds in double precision. The double sum of two float32 values,
    rounded to float32 (``struct``'s "f"), is the float32 sum torch computes:
    double has more than twice float32's precision plus two bits, so the
    double rounding is innocuous (the same holds for the division of a
    mean). A float32 sum that overflows makes ``struct`` raise, and torch
    then computes it (to inf), as every rank does alike."""
    code = _TINY_CODES.get(buf.dtype)
    n = buf.numel()
    if code is None or not 0 < n <= TINY_ELEMS or op not in (ReduceOp.SUM, ReduceOp.MEAN):
        return False
    fmt = _tiny_structs.get((code, n))
    if fmt is None:  # in native byte order, as torch holds the values
        fmt = _tiny_structs[(code, n)] = struct.Struct(f"={n}{code}")
    mine = bytes_view(buf)
    acc = fmt.unpack(got[0] if rank != 0 else mine)
    try:
        for r in range(1, world):
            row = fmt.unpack(got[r] if r != rank else mine)
            # Rounded to the dtype after every step, as torch's adds are.
            acc = fmt.unpack(fmt.pack(*[a + b for a, b in zip(acc, row, strict=True)]))
        if op is ReduceOp.MEAN:
            acc = fmt.unpack(fmt.pack(*[a / world for a in acc]))
    except OverflowError:
        return False
    fmt.pack_into(mine, 0, *acc)
    # Written through its memory, not by a torch op: tell autograd it changed.
    torch.autograd.graph.increment_version(buf)
    return True


def _reduce_into(out: torch.Tensor, values: list[torch.Tensor], op: ReduceOp, world: int) -> None:
    """``out`` = values[0] op values[1] op ... in rank order: the same bits on
    every rank. ``out`` may be one of the values (this rank's own)."""
    if any(v is out for v in values[2:]):
        values = [v.clone() if v is out else v for v in values]  # read after out is written
    reduce = REDUCERS[op]
    reduce(values[0], values[1], out)
    for value in values[2:]:
        reduce(out, value, out)
    if op is ReduceOp.MEAN:
        out.div_(world)


def _reduce(values: list[torch.Tensor], op: ReduceOp, world: int) -> torch.Tensor:
    """:func:`_reduce_into` a new tensor (for an output that may overlap a value)."""
    acc = torch.empty_like(values[0])
    _reduce_into(acc, values, op, world)
    return acc
