"""One exchange, the pure part: which collectives are small, what each
rank sends every other rank, and how each computes the result from what it
received (in rank order, so that every rank gets bitwise the same values).
one_exchange.py (and direct.py, on one host) move the bytes.
"""

from __future__ import annotations

import struct

import torch

from ..errors import FerroGrpcError, Identity, ProtocolError
from ..ops import ReduceOp
from ..transport.wire import bytes_view
from ..v1 import collective_pb2 as pb
from . import schedule
from .descriptor import describe_mismatch
from .jobs import Job
from .reducers import REDUCERS

# A collective of at most this many bytes, on at most this many ranks, runs
# in one exchange.
SMALL_BYTES = 256 << 10
SMALL_WORLD = 16


def is_small(desc: pb.Descriptor, itemsize: int, *, by_part: bool) -> bool:
    """Whether a collective runs in one exchange. With ``by_part``, an
    all-gather or a reduce-scatter is measured by one rank's part (the
    largest, for an uneven reduce-scatter; an all_to_all's, where its
    descriptor holds its size): in one exchange each rank sends every other
    its part, which is what a ring moves too, in a single round
    instead of ``n-1``. Anything else, and those too without ``by_part``, by
    the whole tensor, which each rank sends to every other.

    ``by_part`` is for a group on one host, or with one rank per host:
    where several hosts hold several ranks each, one exchange would send
    every rank's part to every rank on the other hosts, several times the
    cross-host bytes of the two-level path (two_level.py). An all_to_all
    whose descriptor holds no size (its sizes may differ by rank) is not
    measured, and not small here (engine.py runs it in one exchange of
    its own)."""
    numel = desc.numel
    if desc.kind == pb.ALL_TO_ALL and not numel:
        return False
    if by_part and desc.kind in (pb.ALL_GATHER, pb.REDUCE_SCATTER, pb.ALL_TO_ALL):
        numel = -(-numel // max(1, desc.world_size))
    return desc.world_size <= SMALL_WORLD and numel * itemsize <= SMALL_BYTES


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
    if kind == pb.ALL_TO_ALL:
        assert wire is None and job.splits is not None
        ins, outs = job.splits
        at = offsets(ins)
        return {r: buf[at[r] : at[r] + ins[r]] for r in others}, {r: outs[r] * item for r in others}
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
        values = [mine if r == rank else received(got[r], dtype, buf.dtype) for r in range(world)]
        _reduce_into(buf, values, job.op, world)
    elif kind == pb.BROADCAST:
        root = job.descriptor.root
        if rank != root:
            buf.copy_(received(got[root], dtype, buf.dtype))
    elif kind == pb.ALL_GATHER:
        m = n // world
        if wire is not None:
            own = buf[rank * m : (rank + 1) * m]
            own.copy_(own.to(wire))  # as every other rank gets it
        for r, data in got.items():
            buf[r * m : (r + 1) * m].copy_(received(data, dtype, buf.dtype))
    elif kind == pb.ALL_TO_ALL:
        assert job.out is not None and job.splits is not None
        ins, outs = job.splits
        at_in, at_out = offsets(ins), offsets(outs)
        out = job.out
        own = buf[at_in[rank] : at_in[rank] + ins[rank]]
        out[at_out[rank] : at_out[rank] + outs[rank]].copy_(own)
        for r, data in got.items():
            out[at_out[r] : at_out[r] + outs[r]].copy_(received(data, dtype, out.dtype))
        return 0, out.numel()
    elif kind == pb.REDUCE_SCATTER:
        assert job.out is not None
        lo, hi = schedule.split_bounds(0, n, world)[rank]
        values = [
            mine[lo:hi] if r == rank else received(got[r], dtype, buf.dtype) for r in range(world)
        ]
        job.out.copy_(_reduce(values, job.op, world))
        return lo, hi
    return 0, n


def offsets(sizes: list[int]) -> list[int]:
    """Where each rank's part starts, the parts laid end to end in rank order."""
    return [sum(sizes[:r]) for r in range(len(sizes))]


def received(data: memoryview, dtype: torch.dtype, into: torch.dtype) -> torch.Tensor:
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
