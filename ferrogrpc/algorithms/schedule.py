"""The ring schedule: which range of a flat tensor goes where at each step.

Pure arithmetic, no I/O; the async driver in ``ring.py`` streams it.

A collective on ``numel`` elements over ``world`` ranks cuts the tensor into
``world`` segments exactly as ``torch.tensor_split(t.flatten(), world)`` does,
so that reduce_scatter's result on rank r is segment r. Large tensors are also
split into ``lanes``: lane i carries sub-block i of every segment and runs an
independent ring on its own stream, so lanes pipeline on separate connections.
Each (lane, segment) range is cut into chunks of ``chunk_elems`` elements.

Ring steps (rank r, world n, indices mod n):

- reduce-scatter step k in [0, n-1): send segment r-k-1, receive segment
  r-k-2 and reduce it into the local copy. After n-1 steps rank r holds the
  fully reduced segment r.
- all-gather step k in [0, n-1): send segment r-k, receive segment r-k-1.
- all_reduce is the reduce-scatter steps followed by the all-gather steps.

In every one of these, what a rank sends at step s > 0 is exactly what it
received at step s-1, so chunk c of step s may leave as soon as chunk c of
step s-1 has arrived: the schedule pipelines at chunk granularity.

Broadcast is a chain in ring order from the root: each rank forwards chunk c
to its right neighbour as soon as chunk c has arrived.
"""

from __future__ import annotations

import dataclasses

Range = tuple[int, int]


def split_bounds(start: int, stop: int, parts: int) -> list[Range]:
    """Split [start, stop) like ``torch.tensor_split``: the first
    ``(stop-start) % parts`` pieces get one extra element."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    length = stop - start
    if length < 0:
        raise ValueError(f"empty or inverted range [{start}, {stop})")
    base, extra = divmod(length, parts)
    out: list[Range] = []
    pos = start
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((pos, pos + size))
        pos += size
    return out


def chunk_bounds(rng: Range, chunk_elems: int) -> list[Range]:
    """Cut a range into chunks of at most ``chunk_elems`` elements. An empty
    range still yields one empty chunk, so every step sends a message and the
    ring's step-to-step ordering holds for any size."""
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    start, stop = rng
    if stop <= start:
        return [(start, start)]
    return [(a, min(a + chunk_elems, stop)) for a in range(start, stop, chunk_elems)]


def lane_count(nbytes: int, max_lanes: int, lane_min_bytes: int) -> int:
    """How many independent rings a collective of ``nbytes`` uses."""
    if nbytes <= 0:
        return 1
    return max(1, min(max_lanes, nbytes // lane_min_bytes))


@dataclasses.dataclass(frozen=True)
class Step:
    """One ring step: the segment index this rank sends and the one it receives.
    ``reduce`` says whether received data is reduced into (True) or copied
    over (False) the local range."""

    send: int
    recv: int
    reduce: bool


def reduce_scatter_steps(rank: int, world: int) -> list[Step]:
    return [
        Step(send=(rank - k - 1) % world, recv=(rank - k - 2) % world, reduce=True)
        for k in range(world - 1)
    ]


def all_gather_steps(rank: int, world: int) -> list[Step]:
    return [
        Step(send=(rank - k) % world, recv=(rank - k - 1) % world, reduce=False)
        for k in range(world - 1)
    ]


def all_reduce_steps(rank: int, world: int) -> list[Step]:
    return reduce_scatter_steps(rank, world) + all_gather_steps(rank, world)


def chain_position(rank: int, root: int, world: int) -> int:
    """Distance from the root along the broadcast chain (root is 0)."""
    return (rank - root) % world


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every (lane, segment) of a collective lives in the flat tensor."""

    numel: int
    world: int
    lanes: int
    chunk_elems: int
    # segments[j] is the range of segment j; sub[lane][j] the range of lane's
    # sub-block of segment j.
    segments: tuple[Range, ...]
    sub: tuple[tuple[Range, ...], ...]

    @classmethod
    def build(cls, numel: int, world: int, lanes: int, chunk_elems: int) -> Layout:
        segments = tuple(split_bounds(0, numel, world))
        per_segment = [split_bounds(a, b, lanes) for a, b in segments]
        sub = tuple(tuple(per_segment[j][lane] for j in range(world)) for lane in range(lanes))
        return cls(numel, world, lanes, chunk_elems, segments, sub)

    def chunks(self, lane: int, segment: int) -> list[Range]:
        return chunk_bounds(self.sub[lane][segment], self.chunk_elems)


def chunk_elems_for(chunk_bytes: int, itemsize: int) -> int:
    return max(1, chunk_bytes // itemsize)


# [Note: chunks on a link] Between hosts the link, not the CPU, is what a
# ring waits for, and a ring step forwards a chunk only once it has all of
# it: with one chunk per ring segment (a 16 MiB all_reduce at world 4 has
# 4 MiB segments, the default chunk at world 4) every step waits for a whole
# segment. So across hosts, with the default chunk size, a segment gets at
# least SEGMENT_CHUNKS chunks, none under LINK_CHUNK_MIN bytes: at world 4
# on 1 Gbit/s that 16 MiB all_reduce went from 0.81-0.83x gloo to
# 0.94-1.02x (docs/benchmarks-history.md, "Chunk size on a link"). The floor is 256 KiB:
# on a slow link a chunk is a long wait (1 MiB is 84 ms at 100 Mbit/s), and
# at 100 Mbit/s with a 50 ms round trip a 4 MiB all_reduce at world 4 went
# from 0.86-0.89x gloo with a 1 MiB floor to 1.02-1.03x, 1 MiB at world 2
# from 1.11x to 1.27-1.30x, with no change beyond the noise at 1 Gbit/s
# (docs/benchmarks-history.md, "Ring collectives' fixed costs"). On one host (the gRPC
# path with shared memory off), where the CPU is the bottleneck, smaller
# chunks cost per message instead, and the default stands.
SEGMENT_CHUNKS = 4
LINK_CHUNK_MIN = 256 << 10


def link_chunk_bytes(chunk_bytes: int, nbytes: int, world_size: int) -> int:
    """The chunk size across hosts for a collective of ``nbytes`` (as sent):
    ``chunk_bytes``, cut so that a ring segment (``nbytes / world_size``)
    holds at least SEGMENT_CHUNKS chunks, but not below LINK_CHUNK_MIN (nor
    above ``chunk_bytes``). The same on every rank: it depends on the
    descriptor's fields alone."""
    segment = nbytes // max(1, world_size)
    return min(chunk_bytes, max(LINK_CHUNK_MIN, segment // SEGMENT_CHUNKS))


# --- per-lane plans: the exact list of chunks a rank sends and receives ---

REDUCE = 0  # reduce the payload into the local range
REDUCE_LAST = 1  # the last reduce of a segment: finish it (MEAN divides here)
COPY = 2  # copy the payload over the local range


@dataclasses.dataclass(frozen=True)
class RecvItem:
    step: int
    chunk: int
    lo: int
    hi: int
    action: int


@dataclasses.dataclass(frozen=True)
class SendItem:
    step: int
    chunk: int
    lo: int
    hi: int
    # How many receive items must be complete before this chunk may leave.
    after: int
    # Index of the receive item whose result this chunk forwards, or -1 when
    # the chunk is read straight from the rank's own data (step 0).
    from_recv: int


@dataclasses.dataclass(frozen=True)
class LanePlan:
    sends: tuple[SendItem, ...]
    recvs: tuple[RecvItem, ...]


def ring_plan(layout: Layout, lane: int, steps: list[Step]) -> LanePlan:
    """The chunk-level plan of a ring collective (all_reduce, reduce_scatter,
    all_gather) for one lane. Send step s>0 forwards receive step s-1."""
    sends: list[SendItem] = []
    recvs: list[RecvItem] = []
    last_reduce = max((i for i, s in enumerate(steps) if s.reduce), default=-1)
    recv_start: list[int] = []
    for s, step in enumerate(steps):
        recv_start.append(len(recvs))
        action = COPY if not step.reduce else (REDUCE_LAST if s == last_reduce else REDUCE)
        for c, (lo, hi) in enumerate(layout.chunks(lane, step.recv)):
            recvs.append(RecvItem(s, c, lo, hi, action))
    for s, step in enumerate(steps):
        for c, (lo, hi) in enumerate(layout.chunks(lane, step.send)):
            if s == 0:
                sends.append(SendItem(s, c, lo, hi, after=0, from_recv=-1))
            else:
                source = recv_start[s - 1] + c
                src_item = recvs[source]
                if (src_item.lo, src_item.hi) != (lo, hi):
                    raise AssertionError("ring schedule: send does not match previous receive")
                sends.append(SendItem(s, c, lo, hi, after=source + 1, from_recv=source))
    return LanePlan(tuple(sends), tuple(recvs))


def broadcast_plan(layout: Layout, lane: int, rank: int, root: int, world: int) -> LanePlan:
    """The chain plan: the root sends, middle ranks receive and forward chunk by
    chunk, the last rank only receives. ``layout`` has a single segment."""
    pos = chain_position(rank, root, world)
    chunks = chunk_bounds(layout.sub[lane][0], layout.chunk_elems) if world > 1 else []
    recvs = tuple(RecvItem(0, c, lo, hi, COPY) for c, (lo, hi) in enumerate(chunks)) if pos else ()
    sends: tuple[SendItem, ...] = ()
    if pos < world - 1:
        sends = tuple(
            SendItem(0, c, lo, hi, after=(c + 1 if pos else 0), from_recv=(c if pos else -1))
            for c, (lo, hi) in enumerate(chunks)
        )
    return LanePlan(sends, recvs)
