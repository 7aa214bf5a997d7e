"""Blockwise rounding to int8 and int4, pure: how a value travels (``Format``),
how a shard is laid out in bytes, and blocks rounded and added back, their
non-finite values included. The all-reduce that runs it is quantized.py.

[Note: non-finite values]
An Inf or NaN comes back where float32's all-reduce gives it, element by
element, and nowhere else: a NaN or Infs of both signs make NaN, Infs of
one sign that Inf (a finite sum that overflows too). The codes left free
carry them: a block that holds a non-finite value rounds its finite values
to -(qmax - 1)..qmax - 1 (a step of its largest finite magnitude / (qmax -
1)), and sends -qmax for -Inf, qmax for +Inf and -(qmax + 1) for NaN (int8:
-127, 127, -128; int4: -7, 7, -8), with its scale negated (its sign bit
set, -0.0 for zero) to say so. Finding such a block costs no pass over the
values: the blocks' largest magnitudes, computed anyway, are not finite
there. With error feedback a non-finite element carries no error (the next
call starts afresh there) and the block's finite elements carry theirs, so
a training loop that skips the steps whose gradients are not finite (as
AMP's loss scaler does) goes on as float32's would.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Final

import torch

BLOCK = 256  # elements per scale
_TINY = 1e-30  # a block whose scale is below this is sent as zeros


@dataclasses.dataclass(frozen=True)
class Format:
    """How a value travels: an integer of ``bits`` bits in ``[-qmax, qmax]``
    (int8: -127..127; int4: -7..7, two to a byte, offset by 8: the even
    element + 8 in the low nibble, the odd one's in the high), a multiple
    of its block's scale."""

    name: str
    bits: int
    qmax: float

    @property
    def nan_code(self) -> float:
        """The code that sends NaN (see [Note: non-finite values])."""
        return -self.qmax - 1

    def value_bytes(self, elements: int) -> int:
        """Bytes of ``elements`` values (a multiple of BLOCK)."""
        return elements * self.bits // 8

    def store(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """Write the rounded values ``t`` (integers in range, any float
        dtype) into ``out``: their int8, or for int4 their packed bytes."""
        if self.bits == 8:
            out.copy_(t)
            return
        # (even + 8) + 16 (odd + 8), in 17..255: exact in any float dtype.
        pairs = t.reshape(-1, 2)
        both = torch.add(pairs[:, 0], pairs[:, 1], alpha=16)
        out.view(-1).copy_(both.add_(136))

    def load(self, raw: torch.Tensor) -> torch.Tensor:
        """The values in ``raw`` (what :meth:`store` wrote), as int8."""
        if self.bits == 8:
            return raw.view(torch.int8)
        # Each byte becomes two, in one 16-bit word: its low nibble to the
        # first byte in memory, its high nibble to the second.
        u = raw.reshape(-1).to(torch.int16)
        high = (u & 0xF0).bitwise_left_shift_(4)
        low = u.bitwise_and_(0x0F)
        if sys.byteorder == "big":
            low, high = high.bitwise_right_shift_(8), low.bitwise_left_shift_(8)
        return high.bitwise_or_(low).view(torch.int8).sub_(8)


INT8: Final = Format("int8", 8, 127.0)
INT4: Final = Format("int4", 4, 7.0)


def packed_bytes(elements: int, fmt: Format = INT8, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``elements`` (a multiple of BLOCK) packed: their values, then
    one scale per block, in the tensor's ``dtype``."""
    return fmt.value_bytes(elements) + (elements // BLOCK) * dtype.itemsize


def shard_elements(numel: int, world: int) -> int:
    """Elements of each rank's shard: whole blocks, equal on every rank."""
    per = -(-numel // world)
    return max(BLOCK, -(-per // BLOCK) * BLOCK)


class Packed:
    """A shard of ``elements`` packed in the uint8 ``raw``: its values in
    ``fmt``, then its scales in ``dtype`` (the tensor's)."""

    def __init__(self, raw: torch.Tensor, elements: int, fmt: Format, dtype: torch.dtype) -> None:
        self.fmt = fmt
        n = fmt.value_bytes(elements)
        self.values = raw[:n]
        self.scales = raw[n : packed_bytes(elements, fmt, dtype)].view(dtype)

    def _span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bytes of elements [lo, hi) (whole blocks), and their scales."""
        bits = self.fmt.bits
        return self.values[lo * bits // 8 : hi * bits // 8], self.scales[lo // BLOCK : hi // BLOCK]

    def slot(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where elements [lo, hi) (whole blocks) are written: their bytes
        (int8 values as blocks), and their scales."""
        raw, scales = self._span(lo, hi)
        return (raw.view(torch.int8).view(-1, BLOCK) if self.fmt.bits == 8 else raw), scales

    def chunk(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements [lo, hi) (whole blocks): int8 values as blocks, and scales."""
        raw, scales = self._span(lo, hi)
        return self.fmt.load(raw).view(-1, BLOCK), scales


def round_blocks(
    v: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    error: torch.Tensor | None,
    scratch: torch.Tensor,
    fmt: Format = INT8,
) -> None:
    """Round the blocks ``v`` (rows of BLOCK) to ``fmt``'s integers, written
    into ``q`` (:meth:`Packed.slot`'s), with one scale each into
    ``scales`` (``v``'s dtype: largest magnitude / qmax, to nearest); write
    into ``error`` (``v``'s shape; may be ``v`` itself) what the rounding
    lost, as the receivers will see it (always finite). ``scratch``: as
    many elements as ``v``, its dtype. A block holding an Inf or NaN goes as
    [Note: non-finite values] says."""
    # abs_: the largest of +0.0 and -0.0 may be -0.0, and a scale's sign bit
    # marks a block holding a non-finite value.
    largest = torch.maximum(v.amax(dim=1), v.amin(dim=1).neg_()).abs_()
    # amax and amin propagate NaN, and an Inf is its own block's largest
    # magnitude: a check of the maxima, not another pass over the values.
    if not bool(largest.isfinite().all()):
        _round_nonfinite(v, q, scales, error, fmt)
        return
    scale = largest.div_(fmt.qmax)
    scales.copy_(scale)
    inverse = torch.where(scale > _TINY, scale.reciprocal(), torch.zeros_like(scale))
    t = scratch.view(v.shape)
    torch.mul(v, inverse[:, None], out=t)
    # No clamp: |v| <= largest, so |v * inverse| <= qmax * (1 + a few ulps),
    # which rounds to qmax at most (the rounding test checks every magnitude).
    t.round_()
    if error is not None:
        torch.addcmul(v, t, scale[:, None], value=-1, out=error)
    fmt.store(q, t)


def _round_nonfinite(
    v: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    error: torch.Tensor | None,
    fmt: Format,
) -> None:
    """:func:`round_blocks` of blocks some of which hold an Inf or NaN: see
    [Note: non-finite values]. Rare, so it allocates as it likes."""
    # Read before ``error`` (which may be ``v``) is written.
    nan, pos, neg = v.isnan(), v == torch.inf, v == -torch.inf
    bad = nan | pos | neg
    finite = v.masked_fill(bad, 0)
    marked = bad.any(dim=1)
    largest = finite.abs().amax(dim=1)
    scale = largest / torch.where(marked, fmt.qmax - 1, fmt.qmax).to(v.dtype)
    inverse = torch.where(scale > _TINY, scale.reciprocal(), torch.zeros_like(scale))
    t = finite.mul_(inverse[:, None]).round_()
    if error is not None:
        # Zero where ``bad``: there ``finite`` and ``t`` are 0.
        torch.addcmul(v.masked_fill(bad, 0), t, scale[:, None], value=-1, out=error)
    t.masked_fill_(nan, fmt.nan_code).masked_fill_(pos, fmt.qmax).masked_fill_(neg, -fmt.qmax)
    scales.copy_(torch.where(marked, scale.neg(), scale))
    fmt.store(q, t)


def add_blocks(
    into: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, first: bool, fmt: Format
) -> None:
    """``into`` (rows of BLOCK) = (or +=, unless ``first``) ``q * scales``,
    and the non-finite values of the blocks that hold any (a scale with its
    sign bit set: [Note: non-finite values])."""
    marked = scales.signbit()
    if bool(marked.any()):
        _add_nonfinite(into, q, scales, first, fmt, marked)
        return
    scale = scales.to(into.dtype)[:, None]
    if first:
        # A widening copy, then a multiply of one dtype: three times the
        # speed of torch's multiply of mixed dtypes (which casts as it goes).
        into.copy_(q)
        into.mul_(scale)
    else:
        into.addcmul_(q, scale)


def _add_nonfinite(
    into: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    first: bool,
    fmt: Format,
    marked: torch.Tensor,
) -> None:
    """:func:`add_blocks` where the ``marked`` blocks hold non-finite values:
    the others as usual (the marked ones add zero), then the marked ones."""
    add_blocks(into, q, scales.masked_fill(marked, 0), first, fmt)
    rows = marked.nonzero().squeeze(1)
    codes = q[rows]
    values = codes.to(into.dtype).mul_(scales[rows].abs().to(into.dtype)[:, None])
    values.masked_fill_(codes == fmt.nan_code, torch.nan)
    values.masked_fill_(codes == fmt.qmax, torch.inf).masked_fill_(codes == -fmt.qmax, -torch.inf)
    # inf + finite is inf, inf + -inf and NaN + anything NaN: the sum of the
    # ranks' values is float32's, element by element.
    into[rows] = values if first else into[rows] + values
