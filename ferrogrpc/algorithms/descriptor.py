"""What a collective is, as every rank must agree on it: the descriptor that
opens each stream, the check that compares two of them, and the per-lane
plans a descriptor implies on a rank."""

from __future__ import annotations

import functools

import torch

from ..ops import DTYPE_TO_WIRE, OP_TO_WIRE, ReduceOp, kind_name, wire_dtype_name, wire_op_name
from ..transport import integrity
from ..transport.integrity import Checksum
from ..v1 import collective_pb2 as pb
from . import schedule
from .schedule import LanePlan

_FIELDS = (
    # First: other fields may differ between versions too.
    ("protocol", lambda v: f"{v} (ferrogrpc's stream protocol: run one version everywhere)"),
    ("kind", kind_name),
    ("dtype", wire_dtype_name),
    ("numel", str),
    ("reduce_op", wire_op_name),
    ("root", str),
    ("world_size", str),
    # Before the cutting it implies: a chunk's elements follow the wire dtype.
    ("wire_dtype", lambda code: wire_dtype_name(code) if code else "none"),
    ("lanes", str),
    ("chunk_elems", str),
    ("checksum", integrity.kind_name),
    # Last: an elastic group's gradient sync, at different steps.
    ("stamp", lambda v: render_stamp(v)),
)


def render_stamp(stamp: int) -> str:
    """A descriptor's stamp as a reader wants it: epoch and step."""
    if not stamp:
        return "none"
    return f"epoch {stamp >> 32} step {(stamp & 0xFFFFFFFF) - 1}"


def make_stamp(epoch: int, step: int) -> int:
    """The stamp of an elastic group's collectives at ``step`` of ``epoch``."""
    return (epoch << 32) | ((step + 1) & 0xFFFFFFFF)


# The streams' protocol version, in every descriptor: 2, a ring ends with
# world - 1 end markers and no round trip ([Note: end markers], ring.py);
# 3, a ring's float32 chunks may come packed (transport/planes.py), which
# a rank of version 2 would take for a chunk of the wrong size; 4, an int8
# or int4 block marks non-finite values in its scale's sign, a float64
# tensor's scales are float64 ([Note: non-finite values], quantized.py), and
# a descriptor may carry a stamp, which a rank of version 3 would ignore.
PROTOCOL = 4

_REDUCING = (pb.ALL_REDUCE, pb.REDUCE_SCATTER)

# Collectives whose plans are kept (build_plans).
PLANS_KEPT = 256


def make_descriptor(
    kind: int,
    buffer: torch.Tensor,
    op: ReduceOp,
    root: int,
    world_size: int,
    chunking: tuple[int, int],
    lane_min_bytes: int,
    checksum: Checksum | None,
    wire: torch.dtype | None = None,
    link: bool = False,
    uniform: bool = False,
) -> pb.Descriptor:
    """The descriptor of a collective of ``kind`` on the flat ``buffer``,
    cut by ``chunking`` = (chunk_bytes, max_lanes), its chunks travelling
    as ``wire`` (None: as ``buffer``'s dtype). With ``link`` (across hosts,
    the default chunk size), the chunk is cut for the link
    (schedule.link_chunk_bytes, [Note: chunks on a link]). An all_to_all's
    numel is 0, since its sizes may differ by rank (each receiver checks
    the sizes it gets). A ``uniform`` one (equal parts of one size on every
    rank, as the quantized all-reduce's) carries its numel, which every
    receiver checks, and may then run on the direct sockets
    (direct.is_direct)."""
    chunk_bytes, max_lanes = chunking
    itemsize = buffer.element_size()
    if link:
        sent = buffer.numel() * (wire.itemsize if wire else itemsize)
        chunk_bytes = schedule.link_chunk_bytes(chunk_bytes, sent, world_size)
    lanes = schedule.lane_count(buffer.numel() * itemsize, max_lanes, lane_min_bytes)
    return pb.Descriptor(
        kind=kind,  # type: ignore[arg-type]
        dtype=DTYPE_TO_WIRE[buffer.dtype],  # type: ignore[arg-type]
        numel=0 if kind == pb.ALL_TO_ALL and not uniform else buffer.numel(),
        reduce_op=OP_TO_WIRE[op] if kind in _REDUCING else 0,  # type: ignore[arg-type]
        root=root,
        world_size=world_size,
        lanes=lanes,
        # A chunk is chunk_bytes on the wire: in a narrower wire dtype it holds
        # more elements (fewer messages, each costing the same per message).
        chunk_elems=schedule.chunk_elems_for(chunk_bytes, wire.itemsize if wire else itemsize),
        checksum=integrity.checksum_kind(checksum),  # type: ignore[arg-type]
        wire_dtype=DTYPE_TO_WIRE[wire] if wire is not None else 0,  # type: ignore[arg-type]
        protocol=PROTOCOL,
    )


def describe_mismatch(mine: pb.Descriptor, theirs: pb.Descriptor, me: int, them: int) -> str | None:
    """The first field on which two ranks' descriptors differ, naming both
    ranks and both values; None when they agree."""
    for field, render in _FIELDS:
        a = getattr(mine, field)
        b = getattr(theirs, field)
        if a != b:
            return (
                f"ranks disagree on {field}: rank {me} has {field}={render(a)}, "
                f"rank {them} has {field}={render(b)}"
            )
    return None


def build_plans(desc: pb.Descriptor, rank: int, world: int) -> tuple[LanePlan, ...]:
    """The per-lane plans of the collective ``desc`` on ``rank``. They are
    immutable and cached: a collective called again on the same shapes
    reuses its plans (building one costs 0.1-0.4 ms at 64 chunks, at the
    start of every ring collective)."""
    return _plans(desc.kind, desc.numel, desc.lanes, desc.chunk_elems, desc.root, rank, world)


@functools.lru_cache(maxsize=PLANS_KEPT)
def _plans(
    kind: int, numel: int, lanes: int, chunk_elems: int, root: int, rank: int, world: int
) -> tuple[LanePlan, ...]:
    layout_world = 1 if kind == pb.BROADCAST else world
    layout = schedule.Layout.build(numel, layout_world, lanes, chunk_elems)
    if kind == pb.BROADCAST:
        return tuple(
            schedule.broadcast_plan(layout, lane, rank, root, world) for lane in range(lanes)
        )
    if kind in (pb.ALL_REDUCE, pb.BARRIER):
        steps = schedule.all_reduce_steps(rank, world)
    elif kind == pb.REDUCE_SCATTER:
        steps = schedule.reduce_scatter_steps(rank, world)
    else:
        steps = schedule.all_gather_steps(rank, world)
    return tuple(schedule.ring_plan(layout, lane, steps) for lane in range(lanes))
