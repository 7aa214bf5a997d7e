"""How a stream of tensors' bytes is cut into point-to-point messages, by
sender and receiver alike (both compute the same list, so that the n-th
message sent matches the n-th received): the joiner's state transfer
(state.py) and the elastic FSDP re-shard (wrappers/fsdp_elastic.py).

A large segment travels alone, straight from its tensor and into its
destination (no staging copy); small neighbours are packed together; no
message exceeds MESSAGE_BYTES."""

from __future__ import annotations

import dataclasses

import torch

# The most bytes one message carries; a segment smaller than PACK_BELOW is
# packed with its neighbours into one message.
MESSAGE_BYTES = 32 * 2**20
PACK_BELOW = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class Segment:
    tensor: int  # index into the tensor list
    lo: int  # byte range within that tensor
    hi: int


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, as a flat uint8 view (``t`` contiguous, on the CPU)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def stripes(total: int, members: int) -> list[tuple[int, int]]:
    """Byte ranges of the stream, one per member, 64-byte aligned."""
    step = -(-total // members)
    step = -(-step // 64) * 64
    return [(min(total, i * step), min(total, (i + 1) * step)) for i in range(members)]


def messages(sizes: list[int], lo: int, hi: int) -> list[list[Segment]]:
    """The messages of bytes [lo, hi) of the stream of tensors of ``sizes``
    bytes, each a list of segments."""
    out: list[list[Segment]] = []
    packed: list[Segment] = []
    packed_bytes = 0
    start = 0
    for index, size in enumerate(sizes):
        end = start + size
        a, b = max(lo, start), min(hi, end)
        if a < b:
            seg_lo, seg_hi = a - start, b - start
            if seg_hi - seg_lo >= PACK_BELOW:
                if packed:
                    out.append(packed)
                    packed, packed_bytes = [], 0
                for cut in range(seg_lo, seg_hi, MESSAGE_BYTES):
                    out.append([Segment(index, cut, min(seg_hi, cut + MESSAGE_BYTES))])
            else:
                if packed_bytes + (seg_hi - seg_lo) > MESSAGE_BYTES:
                    out.append(packed)
                    packed, packed_bytes = [], 0
                packed.append(Segment(index, seg_lo, seg_hi))
                packed_bytes += seg_hi - seg_lo
        start = end
    if packed:
        out.append(packed)
    return out


def unpack(staged: torch.Tensor, packed: list[Segment], targets: list[torch.Tensor]) -> None:
    """Copy a packed message's bytes (``staged``) into its segments of
    ``targets``."""
    offset = 0
    for seg in packed:
        n = seg.hi - seg.lo
        as_bytes(targets[seg.tensor])[seg.lo : seg.hi].copy_(staged[offset : offset + n])
        offset += n
