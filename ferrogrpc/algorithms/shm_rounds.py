"""Collectives among the ranks of one host, through their shared segments.

Two kinds of *round* do all the work. A partition gives each local rank a
list of element ranges it owns; a phase moves every owner's ranges through
the slots of the segments, a slot's worth per round:

- a **reduce round**: every rank copies its own values for the other owners'
  ranges into its slot and signals WRITTEN; each owner then reduces its
  range from its own tensor and every peer's slot into a target (its own
  tensor in place, or an ``out`` tensor), and signals DONE;
- a **gather round**: every owner copies its range into its slot and
  signals WRITTEN; every rank copies the others' ranges out of their slots,
  and signals DONE.

An all_to_all is an exchange instead (:meth:`LocalGroup.all_to_all`): the
message that begins it carries each rank's row of the counts and the small
pieces, and the larger pieces go through the slots in gather-like rounds.

A slot is written again only after every local peer signalled DONE for the
round that last used it, so a fast rank runs at most ``slots`` rounds ahead.
Each element is reduced by exactly one rank, in local-rank order, so every
rank ends with bitwise identical values. Reductions and copies run on the
backend's loop thread, as the ring's do; no checksum is computed here: the
bytes never leave this host's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import FerroGrpcError, Identity, ProtocolError
from ..failure.watchdog import Watchdog
from ..observe.stats import Stats
from ..ops import ReduceOp
from ..samehost.plane import BEGIN, DONE, REDUCED, SMALL, WRITTEN, LocalPlane, split_small
from ..transport.wire import bytes_view
from ..v1 import collective_pb2 as pb
from . import schedule
from .context import RankContext
from .descriptor import describe_mismatch
from .exchange_plan import mismatch, offsets, wrong_size
from .jobs import Job, JobTable
from .reducers import REDUCERS, Reducer
from .staging import Stage

Range = tuple[int, int]
Partition = list[list[Range]]  # by local index: the ranges that index owns

# An all_to_all's piece of at most this many bytes travels in the message
# that begins the collective (one socket write); a larger one through the
# slots.
INLINE_BYTES = 64 << 10
# The most of one piece an all_to_all writes into a slot per round: the
# segments' pages it touches stay resident in every process that maps them.
# Elastic FSDP's hand-over (one 25 MB piece to the buddy, 4 ranks) through
# whole 16 MiB slots held 104-110 MiB of segment pages per process against
# 20 MiB for fixed FSDP's collectives; in 4 MiB rounds 64-72 MiB, and its
# peak RSS over fixed FSDP's fell from 125-189 MiB to 95-132 MiB, the step
# no slower (four pairs each). Several large pieces still share a whole
# slot (4 MiB to each of 3 peers: one round, 13.7-15.2 ms; a 4 MiB slot in
# all took 3 rounds, 18.8-20.2 ms).
A2A_ROUND_BYTES = 4 << 20


def _pieces(ranges: list[Range], a: int, b: int) -> list[Range]:
    """The absolute ranges at positions [a, b) of ``ranges`` laid end to end."""
    out: list[Range] = []
    pos = 0
    for lo, hi in ranges:
        n = hi - lo
        s, e = max(a, pos), min(b, pos + n)
        if s < e:
            out.append((lo + s - pos, lo + e - pos))
        pos += n
        if pos >= b:
            break
    return out


class LocalGroup:
    """One collective's view of this host's ranks: runs reduce and gather
    phases for ``job`` on ``plane``, with waits watched by ``watch``."""

    def __init__(
        self,
        me: Identity,
        plane: LocalPlane,
        local: Sequence[int],
        job: Job,
        watch: Watchdog,
        stats: Stats,
    ) -> None:
        self.me = me
        self.stats = stats
        self.plane = plane
        self.local = list(local)
        self.index = self.local.index(me.rank)
        self.peers = [r for r in self.local if r != me.rank]
        self.job = job
        self.watch = watch
        # True from the start of a phase until it ends: stopped in between,
        # this rank and its host's other ranks may disagree on which rounds
        # ran (see FailurePolicy.plane_survives).
        self.mid_round = False

    async def begin(self) -> None:
        """Exchange descriptors with every local peer: a ProtocolError naming
        both ranks on any difference. Also a barrier among the host's ranks."""
        job, plane = self.job, self.plane
        mine = job.descriptor.SerializeToString()
        plane.announce(job.seq, mine)
        for rank in self.peers:
            kind, theirs = await self.watch.wait(
                f"r{rank}", rank, f"{job.name}#{job.seq} to start at", plane.first(rank, job.seq)
            )
            if kind == SMALL:
                theirs = split_small(theirs)[0]
            if theirs != mine or kind != BEGIN:
                other = pb.Descriptor.FromString(theirs)
                mismatch = describe_mismatch(job.descriptor, other, self.me.rank, rank)
                raise self.me.error(
                    ProtocolError,
                    mismatch or f"rank {rank} ran it as a small collective, this rank did not",
                    op=job.name,
                    seq=job.seq,
                    peer=rank,
                )

    async def _all(self, kind: int, round_: int, what: str) -> None:
        for rank in self.peers:
            await self._one(kind, rank, round_, what)

    async def _one(self, kind: int, rank: int, round_: int, what: str) -> None:
        link = self.plane.links[rank]
        counter = {WRITTEN: link.written, REDUCED: link.reduced, DONE: link.done}[kind]
        if counter.value <= round_:
            await self.watch.wait(f"r{rank}", rank, what, counter.wait_for(round_ + 1))

    async def _slot_free(self, g: int) -> None:
        slots = self.plane.slots
        if g >= slots:
            await self._all(DONE, g - slots, "a slot to be released by")

    def _regions(self, parts: Partition, itemsize: int) -> tuple[int, list[int]]:
        """Elements per owner per round, and each owner's region in a slot."""
        owners = [i for i, ranges in enumerate(parts) if ranges]
        per = max(1, self.plane.slot_bytes // (max(1, len(owners)) * itemsize))
        region = [0] * len(parts)
        for place, i in enumerate(owners):
            region[i] = place * per
        return per, region

    async def reduce_phase(
        self,
        parts: Partition,
        source: torch.Tensor,
        target: Callable[[int, int], torch.Tensor],
        op: ReduceOp,
        divide: int = 1,
    ) -> None:
        """Reduce every owner's ranges of ``source`` across the host: this
        rank's ranges land in ``target(lo, hi)``, divided by ``divide``."""
        self.mid_round = True
        plane, dtype = self.plane, source.dtype
        per, region = self._regions(parts, source.element_size())
        rounds = -(-max((sum(h - lo for lo, h in r) for r in parts), default=0) // per)
        reduce: Reducer = REDUCERS[op]
        mine = parts[self.index]
        for k in range(rounds):
            g = plane.next_round()
            await self._slot_free(g)
            slot = plane.slot(self.me.rank, g % plane.slots).view(dtype)
            for i, ranges in enumerate(parts):
                if i == self.index:
                    continue
                at = region[i]
                for lo, hi in _pieces(ranges, k * per, (k + 1) * per):
                    slot[at : at + hi - lo].copy_(source[lo:hi])
                    at += hi - lo
            plane.send(WRITTEN, g)
            await self._all(WRITTEN, g, f"round {g} to be written by")
            at = region[self.index]
            for lo, hi in _pieces(mine, k * per, (k + 1) * per):
                out = target(lo, hi)
                first = True
                for rank in self.peers:
                    theirs = plane.slot(rank, g % plane.slots).view(dtype)[at : at + hi - lo]
                    reduce(source[lo:hi] if first else out, theirs, out)
                    self.stats.local(rank, theirs.numel() * theirs.element_size())
                    first = False
                if first:
                    out.copy_(source[lo:hi])
                if divide > 1:
                    out.div_(divide)
                at += hi - lo
            plane.send(DONE, g)
        self.mid_round = False

    async def all_reduce_phase(
        self,
        parts: Partition,
        buf: torch.Tensor,
        op: ReduceOp,
        divide: int = 1,
        stage: Stage | None = None,
    ) -> None:
        """All-reduce ``buf`` in place across the host, one round per slot:
        every rank writes its values for the other owners' ranges into its
        slot; each owner reduces its own range into its slot's own region
        (which held nothing) and signals REDUCED; every rank then copies
        every owner's result out of that region."""
        self.mid_round = True
        plane, dtype = self.plane, buf.dtype
        per, region = self._regions(parts, buf.element_size())
        rounds = -(-max((sum(h - lo for lo, h in r) for r in parts), default=0) // per)
        reduce: Reducer = REDUCERS[op]
        mine = parts[self.index]
        stats = self.stats
        itemsize = buf.element_size()
        for k in range(rounds):
            g = plane.next_round()
            await self._slot_free(g)
            slot = plane.slot(self.me.rank, g % plane.slots).view(dtype)
            for i, ranges in enumerate(parts):
                if i == self.index:
                    continue
                at = region[i]
                for lo, hi in _pieces(ranges, k * per, (k + 1) * per):
                    slot[at : at + hi - lo].copy_(buf[lo:hi])
                    at += hi - lo
            plane.send(WRITTEN, g)
            await self._all(WRITTEN, g, f"round {g} to be written by")
            at = region[self.index]
            for lo, hi in _pieces(mine, k * per, (k + 1) * per):
                out = slot[at : at + hi - lo]
                first = True
                for rank in self.peers:
                    theirs = plane.slot(rank, g % plane.slots).view(dtype)[at : at + hi - lo]
                    reduce(buf[lo:hi] if first else out, theirs, out)
                    stats.local(rank, (hi - lo) * itemsize)
                    first = False
                if first:
                    out.copy_(buf[lo:hi])
                if divide > 1:
                    out.div_(divide)
                at += hi - lo
            plane.send(REDUCED, g)
            for i, rank in enumerate(self.local):
                if not parts[i]:
                    continue
                if i != self.index:
                    await self._one(REDUCED, rank, g, f"round {g} to be reduced by")
                theirs = plane.slot(rank, g % plane.slots).view(dtype)
                at = region[i]
                for lo, hi in _pieces(parts[i], k * per, (k + 1) * per):
                    buf[lo:hi].copy_(theirs[at : at + hi - lo])
                    if i != self.index:
                        stats.local(rank, (hi - lo) * itemsize)
                    if stage is not None:
                        stage.final(lo, hi)
                    at += hi - lo
            plane.send(DONE, g)
        self.mid_round = False

    async def gather_phase(
        self,
        parts: Partition,
        buffer: torch.Tensor,
        stage: Stage | None = None,
    ) -> None:
        """Copy every owner's ranges of ``buffer`` into every other rank's
        ``buffer``; ``stage`` learns which ranges became final."""
        self.mid_round = True
        plane, dtype = self.plane, buffer.dtype
        per, region = self._regions(parts, buffer.element_size())
        rounds = -(-max((sum(h - lo for lo, h in r) for r in parts), default=0) // per)
        for k in range(rounds):
            g = plane.next_round()
            await self._slot_free(g)
            slot = plane.slot(self.me.rank, g % plane.slots).view(dtype)
            at = region[self.index]
            for lo, hi in _pieces(parts[self.index], k * per, (k + 1) * per):
                if stage is not None:
                    await stage.ready(lo, hi)
                slot[at : at + hi - lo].copy_(buffer[lo:hi])
                at += hi - lo
            plane.send(WRITTEN, g)
            for i, rank in enumerate(self.local):
                if i == self.index or not parts[i]:
                    continue
                if plane.links[rank].written.value <= g:
                    await self.watch.wait(
                        f"r{rank}",
                        rank,
                        f"round {g} to be written by",
                        plane.links[rank].written.wait_for(g + 1),
                    )
                theirs = plane.slot(rank, g % plane.slots).view(dtype)
                at = region[i]
                for lo, hi in _pieces(parts[i], k * per, (k + 1) * per):
                    buffer[lo:hi].copy_(theirs[at : at + hi - lo])
                    self.stats.local(rank, (hi - lo) * buffer.element_size())
                    if stage is not None:
                        stage.final(lo, hi)
                    at += hi - lo
            plane.send(DONE, g)
        self.mid_round = False

    async def all_to_all(self, job: Job) -> None:
        """``job``, an all_to_all among the host's ranks (the whole group).
        This rank's first message to each peer carries its descriptor, its
        row of the counts (the elements it sends each rank) and, if at most
        INLINE_BYTES, the piece for that peer: a ProtocolError naming both
        ranks if the peer expects another size or runs another collective.
        Every rank then knows every row, so all count the same rounds for
        the larger pieces: per round, each sender writes the next part of
        each of its large pieces into its slot (split evenly among them)
        and signals WRITTEN; each receiver copies its parts out, and
        signals DONE."""
        plane, me, out = self.plane, self.me.rank, job.out
        assert out is not None and job.splits is not None
        ins, outs = job.splits
        source, item = job.buffer, job.buffer.element_size()
        at_in, at_out = offsets(ins), offsets(outs)
        inline = INLINE_BYTES // item
        desc = job.descriptor.SerializeToString()
        row = torch.tensor(ins, dtype=torch.int64)
        head = bytes(bytes_view(row))
        for rank in self.peers:
            piece = source[at_in[rank] : at_in[rank] + ins[rank]] if ins[rank] <= inline else None
            body = head if piece is None else head + bytes(bytes_view(piece))
            plane.send_small(rank, job.seq, desc, memoryview(body))
        out[at_out[me] : at_out[me] + outs[me]].copy_(source[at_in[me] : at_in[me] + ins[me]])
        rows = {me: ins}
        for rank in self.peers:
            kind, payload = await self.watch.wait(
                f"r{rank}", rank, f"{job.name}#{job.seq} to start at", plane.first(rank, job.seq)
            )
            if kind != SMALL:
                other = pb.Descriptor.FromString(payload)
                raise mismatch(self.me, job, rank, other, "ran it through shared segments")
            theirs, data = split_small(payload)
            if theirs != desc:
                raise mismatch(self.me, job, rank, pb.Descriptor.FromString(theirs), "disagrees")
            if data.nbytes < len(head):  # not a row of this world's counts
                raise wrong_size(self.me, job, rank, data.nbytes, len(head))
            counts = torch.frombuffer(data[: len(head)], dtype=torch.int64).tolist()
            got = counts[me]
            if got != outs[rank]:
                raise wrong_size(self.me, job, rank, got * item, outs[rank] * item)
            rows[rank] = counts
            if got <= inline:
                if data.nbytes - len(head) != got * item:
                    raise wrong_size(self.me, job, rank, data.nbytes - len(head), got * item)
                if got:
                    into = out[at_out[rank] : at_out[rank] + got]
                    into.copy_(torch.frombuffer(data[len(head) :], dtype=source.dtype))
                    self.stats.local(rank, got * item)
        # Each sender's large pieces, and the elements of each per round.
        large = {s: [d for d, n in enumerate(r) if d != s and n > inline] for s, r in rows.items()}
        per = {
            s: max(1, min(plane.slot_bytes // max(1, len(d)), A2A_ROUND_BYTES) // item)
            for s, d in large.items()
        }
        rounds = max((-(-rows[s][d] // per[s]) for s, ds in large.items() for d in ds), default=0)
        senders = [s for s in self.peers if me in large[s]]
        self.mid_round = True
        for k in range(rounds):
            g = plane.next_round()
            await self._slot_free(g)
            p = per[me]
            slot = plane.slot(me, g % plane.slots).view(source.dtype)
            for place, d in enumerate(large[me]):
                lo, hi = k * p, min((k + 1) * p, ins[d])
                if lo < hi:
                    slot[place * p : place * p + hi - lo].copy_(
                        source[at_in[d] + lo : at_in[d] + hi]
                    )
            plane.send(WRITTEN, g)
            for s in senders:
                p, place = per[s], large[s].index(me)
                lo, hi = k * p, min((k + 1) * p, outs[s])
                if lo >= hi:
                    continue
                await self._one(WRITTEN, s, g, f"round {g} to be written by")
                sent = plane.slot(s, g % plane.slots).view(source.dtype)
                out[at_out[s] + lo : at_out[s] + hi].copy_(sent[place * p : place * p + hi - lo])
                self.stats.local(s, (hi - lo) * item)
            plane.send(DONE, g)
        self.mid_round = False


def segments(numel: int, count: int) -> Partition:
    """The ring's segments, one per owner: ``tensor_split`` of [0, numel)."""
    return [[r] for r in schedule.split_bounds(0, numel, count)]


async def run_single_host(group: LocalGroup, job: Job, world: int) -> None:
    """``job`` among the ranks of one host, which is the whole group."""
    if job.kind == pb.ALL_TO_ALL:
        await group.all_to_all(job)
        return
    await group.begin()
    kind, buf, stage = job.kind, job.buffer, job.stage
    n, local, index = buf.numel(), group.local, group.index
    if kind == pb.BARRIER:
        return
    if stage is not None and kind in (pb.ALL_REDUCE, pb.REDUCE_SCATTER):
        await stage.ready(0, n)
    if kind == pb.ALL_REDUCE:
        parts = segments(n, len(local))
        divide = world if job.op is ReduceOp.MEAN else 1
        await group.all_reduce_phase(parts, buf, job.op, divide, stage)
    elif kind == pb.REDUCE_SCATTER:
        out, offset = job.out, job.out_offset
        assert out is not None
        parts = segments(n, len(local))
        divide = world if job.op is ReduceOp.MEAN else 1
        await group.reduce_phase(
            parts, buf, lambda lo, hi: out[lo - offset : hi - offset], job.op, divide
        )
        if stage is not None:
            for lo, hi in parts[index]:
                stage.final(lo, hi)
    elif kind == pb.ALL_GATHER:
        m = n // world
        parts = [[(r * m, r * m + m)] for r in local]
        await group.gather_phase(parts, buf, stage)
    elif kind == pb.BROADCAST:
        root = job.descriptor.root
        parts = [[(0, n)] if r == root else [] for r in local]
        await group.gather_phase(parts, buf, stage)
    else:  # pragma: no cover - every kind is handled above
        raise FerroGrpcError(f"unknown collective kind {kind}")


class LocalRunner:
    """Runs one collective among the ranks of one host (the whole group),
    watched like a lane; on failure, tells the host's other ranks why."""

    def __init__(
        self, ctx: RankContext, jobs: JobTable, plane: LocalPlane, local: Sequence[int], job: Job
    ) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.plane = plane
        self.job = job
        me = ctx.identity
        self.watch = Watchdog(me, ctx.transport, ctx.timeouts.idle, job.name, job.seq)
        self.group = LocalGroup(me, plane, local, job, self.watch, ctx.stats)

    async def run(self) -> None:
        job, ctx, plane = self.job, self.ctx, self.plane
        # Rounds and slots are shared by every collective on the plane: they
        # take turns, in sequence order (the same order on every rank).
        await self.jobs.turn(job.seq)
        try:
            await self.watch.guard(run_single_host(self.group, job, ctx.identity.world_size))
        except BaseException as exc:
            cause = ctx.failure.cause(exc, job.name, job.seq, self.watch.first_failure)
            if not ctx.failure.plane_survives(cause, self.group.mid_round):
                plane.abort(ctx.failure.abort_message(cause))
            raise
