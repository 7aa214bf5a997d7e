"""int8 and int4 on the wire: blockwise-scaled quantization, the all-reduce
built on it, and the error feedback that DDP's ``compression="int8"``
carries.

[Note: int8 all-reduce]
A ring that adds int8 partial sums would round each partial sum again at
every hop: the error would grow with the world size, and no rank's input
would be rounded only once. This all-reduce rounds each value exactly
twice, whatever the world size:

1. Every rank rounds its own tensor ``v`` to int8 in blocks of ``BLOCK``
   elements, each block with its own scale ``s = max|v_block| / 127``, in
   the tensor's dtype (float32, or float64 for a float64 tensor: a float32
   scale could not hold a float64 block above about 4e40). The tensor is
   cut into ``world_size`` shards (whole blocks).
2. An all-to-all sends shard j of every rank to rank j (int8 plus the
   scales: 1 + 4/BLOCK bytes per element, 1 + 8/BLOCK for float64).
3. Rank j dequantizes the ``world_size`` copies of its shard and adds them in
   rank order, in float32 (float64 for a float64 tensor), then divides by
   the world size for a mean.
4. Rank j rounds that sum to int8 blocks once more, and an all-gather gives
   every rank every shard, which every rank (rank j too) dequantizes. So
   every rank ends with bitwise identical values.

Bytes: each rank sends (n-1)/n of the tensor twice, at 1 + 4/BLOCK bytes an
element: about a quarter of a float32 ring's 2(n-1)/n x 4 bytes.

Range: any finite value of the tensor's dtype is sent (a scale is at most
the dtype's largest value / 127). A block whose largest magnitude is below
127 x 1e-30 (int4: 7 x 1e-30) is sent as zeros. A sum or mean that
overflows the dtype is Inf, of its sign, as float32's all-reduce gives.

The bound. For an element in block b, with ``s_r`` rank r's scale of that
block in step 1 and ``s_out`` the owner's in step 4 (each the block's
largest magnitude / 127, rounding to nearest):

    |result - sum_r v_r| <= sum_r s_r / 2 + s_out / 2

(for a mean, the first term divided by the world size). That is at most
half of one int8 step of each input block, plus one of the result's.

int4 (``wire_dtype=torch.int4``; DiLoCo's ``compression="int4"``) is the
same all-reduce with values in -7..7, two to a byte, and scales of
``max|v_block| / 7``: 1/2 + 4/BLOCK bytes an element, about half of int8's,
and the same bound with those scales (18 times int8's). It is meant for
what is averaged rarely and tolerates it, as DiLoCo's pseudo-gradients
(arXiv 2501.18512 sends them in 4 bits), not for gradients every step.

Error feedback (``ErrorFeedback``, DDP's ``compression="int8"``): what
step 1 rounded away on this rank is added to the next call's input, and
what step 4 rounded away on the shard's owner to the next call's sum. No
rounding error is lost: over many steps the applied updates follow the
exact ones (the sum of what was sent equals the sum of the inputs, less
the error still carried, which stays within one step's bound). A change of
the world size (an elastic group's new epoch) changes the shards, and the
carried error starts again from zero. The carried error is always finite:
a non-finite element carries nothing (see [Note: non-finite values]).

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

import asyncio
import atexit
import collections
import contextlib
import copy
import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Final, Protocol

import torch

from ..errors import FerroGrpcError
from ..ops import INT4 as INT4_DTYPE
from ..ops import ReduceOp

BLOCK = 256  # elements per scale
CHUNK = 4096 * BLOCK  # elements rounded at a time (bounds the scratch memory)
PIECE = 4 * CHUNK  # elements of a tensor's pieces, which pipeline (16 MiB of float32)
# Pieces exchanged at a time. Three keep a slow link busy while a piece's
# rounding and summing hold the rank's core (a DDP int8 step of the 25.2M
# MLP at 1 Gbit/s: median 0.352 s over six runs against 0.369 s over nine
# with two, 2026-12-05); four gave the same as three.
IN_FLIGHT = 3
# A piece of at most this many elements is rounded on the caller's thread,
# and reduced and written on the event loop (0.1-0.4 ms each there), not
# handed to the rounding thread and the executor: for a small tensor the
# hand-offs cost more than the work. A fifth of BENCHMARKS' char LM (370k
# elements, int4, world 2) cost a rank 2.55-2.68 ms of CPU per call so,
# 3.1-3.55 ms with the hand-offs.
INLINE_BELOW = 1 << 19
_TINY = 1e-30  # a block whose scale is below this is sent as zeros


class _Rounder:
    """Runs the rounding of int8 all-reduces in call order, off the callers'
    threads and the event loop, on one thread. The thread stays for
    ``LINGER_S`` after its last piece of work, then exits: no thread
    outlives a run by more than that. Lingering, because starting a thread
    cost the caller 1.5 ms on this project's 2-core machine (the start
    waits for the new thread to run), and int8 all-reduces come in runs:
    DDP's buckets, a step apart; DiLoCo's fragments, H / F steps apart.
    At the interpreter's exit an idle thread is let go at once (atexit),
    not left for the finalization to stop."""

    LINGER_S = 2.0

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)
        atexit.register(self.close)

    def _reset(self) -> None:
        # (In a forked child too: the parent's thread is not there.)
        self._ready = threading.Condition()
        self._queue: collections.deque[tuple[Callable[[], None], Future[None]]] = (
            collections.deque()
        )
        self._running = False
        self._closing = False
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """Let the thread go once its queue is empty, and wait for it (up to
        a second); a later submit starts a new one."""
        with self._ready:
            self._closing = True
            self._ready.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=1.0)
        with self._ready:
            self._closing = False

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        with self._ready:
            self._queue.append((fn, future))
            if self._running:
                self._ready.notify()
            else:
                self._running = True
                self._thread = threading.Thread(
                    target=self._drain, name="ferrogrpc-int8", daemon=True
                )
                self._thread.start()
        return future

    def _drain(self) -> None:
        while True:
            with self._ready:
                if not self._queue:
                    if not self._closing:
                        self._ready.wait(self.LINGER_S)
                    if not self._queue:
                        self._running = False
                        self._thread = None
                        return
                fn, future = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    fn()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(None)


_ROUNDER = _Rounder()


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
# The wire dtypes of all_reduce that take this path.
FORMATS: Final = {torch.int8: INT8, INT4_DTYPE: INT4}


def packed_bytes(elements: int, fmt: Format = INT8, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``elements`` (a multiple of BLOCK) packed: their values, then
    one scale per block, in the tensor's ``dtype``."""
    return fmt.value_bytes(elements) + (elements // BLOCK) * dtype.itemsize


def shard_elements(numel: int, world: int) -> int:
    """Elements of each rank's shard: whole blocks, equal on every rank."""
    per = -(-numel // world)
    return max(BLOCK, -(-per // BLOCK) * BLOCK)


class _Packed:
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
    into ``q`` (:meth:`_Packed.slot`'s), with one scale each into
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


@dataclasses.dataclass
class ErrorFeedback:
    """The rounding error an int8 all-reduce carries to its next call on the
    same tensor (see [Note: int8 all-reduce]): ``sent``, this rank's input
    error (the padded tensor's length), and ``owned``, the error of the shard
    this rank owns. Empty until the first call; reset when the layout (the
    size, the world size) changes, and after a call that failed."""

    sent: torch.Tensor | None = None
    owned: torch.Tensor | None = None
    world: int = 0
    # The tensor's last ``exact`` elements travel unrounded, in its own
    # dtype, and carry no error (DDP's "had a gradient" flags): every rank
    # sends them to every rank, and each adds them in rank order.
    exact: int = 0
    # A tensor sent in pieces: each piece's own (see :meth:`split`).
    parts: list[ErrorFeedback] = dataclasses.field(default_factory=list)

    def fits(self, padded: int, shard: int, world: int, like: torch.Tensor) -> None:
        """Start again from zero unless the last call had this layout."""
        if (
            self.sent is None
            or self.owned is None
            or self.world != world
            or self.sent.numel() != padded
            or self.owned.numel() != shard
            or self.sent.dtype != like.dtype
        ):
            self.sent = torch.zeros(padded, dtype=like.dtype)
            self.owned = torch.zeros(shard, dtype=like.dtype)
            self.world = world

    def reset(self) -> None:
        self.sent = self.owned = None
        self.world = 0
        self.parts = []

    def split(self, count: int) -> list[ErrorFeedback]:
        """The feedback of each of a tensor's ``count`` pieces (the exact tail
        is the last piece's), kept while the count stays."""
        if len(self.parts) != count:
            self.parts = [ErrorFeedback() for _ in range(count)]
        self.parts[-1].exact = self.exact
        return self.parts


class Collectives(Protocol):
    """What the int8 all-reduce needs of a rank's Peer."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_to_all_single(
        self, out: torch.Tensor, tensor: torch.Tensor, *, uniform: bool
    ) -> Coroutine[Any, Any, torch.Tensor]: ...

    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor
    ) -> Coroutine[Any, Any, torch.Tensor]: ...


def all_reduce_quantized(
    peer: Collectives,
    tensor: torch.Tensor,
    op: ReduceOp,
    feedback: ErrorFeedback | None = None,
    fmt: Format = INT8,
) -> Coroutine[Any, Any, torch.Tensor]:
    """The all-reduce of [Note: int8 all-reduce] in ``fmt``, in place on ``tensor``
    (float32 or float64, SUM or MEAN; the caller checked), in pieces of at
    most PIECE elements that pipeline: a piece's exchange is on the wire
    while the next one is rounded and the last one's result is summed or
    written. Every piece's collectives take their sequence numbers now, in
    call order. Returns ``tensor``; on failure its contents are unspecified
    (some pieces done) and ``feedback`` is reset."""
    exact = min(feedback.exact, tensor.numel()) if feedback is not None else 0
    numel = tensor.numel() - exact
    count = max(1, -(-numel // PIECE))
    if count == 1:
        return _named(_all_reduce_piece(peer, tensor, op, feedback, fmt), fmt)
    flat = tensor.detach().reshape(-1)
    direct = flat.device.type == "cpu" and tensor.is_contiguous()
    work = flat if direct else flat.to("cpu", copy=True)
    parts = feedback.split(count) if feedback is not None else [None] * count
    pieces = []
    for i in range(count):
        lo, hi = i * PIECE, (i + 1) * PIECE if i + 1 < count else tensor.numel()
        pieces.append(_all_reduce_piece(peer, work[lo:hi], op, parts[i], fmt))

    async def run() -> torch.Tensor:
        # IN_FLIGHT pieces at a time: one's all-gather is not queued behind
        # every later piece's all-to-all on the link.
        window = asyncio.Semaphore(IN_FLIGHT)

        async def piece(coro: Coroutine[Any, Any, torch.Tensor]) -> torch.Tensor:
            async with window:
                return await coro

        results = await asyncio.gather(*(piece(c) for c in pieces), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                if feedback is not None:
                    feedback.reset()
                raise as_all_reduce(result, fmt) from result
        if not direct:
            with torch.no_grad():
                tensor.copy_(work.view(tensor.shape))
        return tensor

    return run()


def as_all_reduce(exc: BaseException, fmt: Format = INT8) -> BaseException:
    """A failure of one of the quantized all-reduce's inner collectives, as the
    caller's ``all_reduce`` raises it: the same error (class, rank, peer,
    evidence), named ``all_reduce``, its message saying which inner
    collective failed (the flight record and the other ranks name that
    one)."""
    if not isinstance(exc, FerroGrpcError) or exc.op == "all_reduce":
        return exc
    inner = f"{exc.op}#{exc.seq}" if exc.seq is not None else str(exc.op)
    named = copy.copy(exc)
    named.op, named.seq = "all_reduce", None
    named.message = f"(wire_dtype={fmt.name}: its {inner} failed) {exc.message}"
    named.args = (named.message,)
    return named


async def _named(call: Coroutine[Any, Any, torch.Tensor], fmt: Format) -> torch.Tensor:
    try:
        return await call
    except FerroGrpcError as exc:
        raise as_all_reduce(exc, fmt) from exc


def _all_reduce_piece(
    peer: Collectives,
    tensor: torch.Tensor,
    op: ReduceOp,
    feedback: ErrorFeedback | None,
    fmt: Format,
) -> Coroutine[Any, Any, torch.Tensor]:
    """One piece of :func:`all_reduce_quantized`: an all-to-all and an
    all-gather; the rounding runs off the event loop (but for a piece of at
    most INLINE_BELOW elements), a CHUNK at a time. On failure ``tensor``
    is unchanged and ``feedback`` reset."""
    world, rank = peer.world_size, peer.rank
    exact = min(feedback.exact, tensor.numel()) if feedback is not None else 0
    numel = tensor.numel() - exact
    shard = shard_elements(numel, world)
    compute = tensor.dtype  # float32 or float64: the scales' dtype too
    row = packed_bytes(shard, fmt, compute)
    tail = exact * tensor.element_size()
    # An all-to-all row: a packed shard, then the exact tail, both 8-byte
    # aligned (a float64 tail is viewed where it lies).
    row_pad = -row % 8
    stride = row + row_pad + -(-tail // 8) * 8
    send = torch.empty(world * stride, dtype=torch.uint8)
    received = torch.empty(world * stride, dtype=torch.uint8)
    gathered = torch.empty(world * row, dtype=torch.uint8)
    # This rank's block of the gather, written (by reduce_owned) before the
    # gather runs: a CPU gather works in place, and copies ``mine`` into
    # ``gathered`` when called, here onto itself.
    mine = gathered[rank * row : (rank + 1) * row]
    # Every rank's rows are one size (uniform): a small all-to-all runs on
    # the direct sockets, as the gather does, not as gRPC messages.
    exchange = peer.all_to_all_single(received, send, uniform=True)
    gather = peer.all_gather_into_tensor(gathered, mine)
    exact_sum = torch.zeros(exact, dtype=compute)
    # No chunk crosses a shard, so none is longer than this. ``padded`` is
    # written before each use (zeroed for the padding, overwritten as the
    # sum and the staged result): a small tensor's call neither allocates
    # nor clears a whole CHUNK.
    span = min(CHUNK, shard)
    scratch = torch.empty(span, dtype=compute)
    padded = torch.empty(span, dtype=compute)

    def source() -> torch.Tensor:
        """The tensor's rounded part, flat, on the CPU (a view if it can)."""
        flat = tensor.detach().reshape(-1)[:numel]
        return flat.cpu() if flat.device.type != "cpu" else flat

    def round_inputs() -> None:
        flat = source()
        carried: torch.Tensor | None = None
        if feedback is not None:
            feedback.fits(world * shard, shard, world, flat)
            carried = feedback.sent
            assert carried is not None
            carried[:numel].add_(flat)  # now the values to send (the error, after)
        for j in range(world):
            out = _Packed(send[j * stride : j * stride + row], shard, fmt, compute)
            for lo in range(j * shard, (j + 1) * shard, CHUNK):
                hi = min(lo + CHUNK, (j + 1) * shard)
                if carried is not None:
                    v = carried[lo:hi]
                elif hi <= numel:
                    v = flat[lo:hi]
                else:  # the padding: zeros past the tensor's end
                    v = padded[: hi - lo]
                    v.zero_()
                    if lo < numel:
                        v[: numel - lo].copy_(flat[lo:numel])
                blocks = v.view(-1, BLOCK)
                q, scales = out.slot(lo - j * shard, hi - j * shard)
                err = blocks if carried is not None else None
                round_blocks(blocks, q, scales, err, scratch[: hi - lo], fmt)
        if exact:
            unrounded = tensor.detach().reshape(-1)[numel:].cpu().contiguous()
            for j in range(world):
                at = j * stride + row + row_pad
                send[at : at + tail].copy_(unrounded.view(torch.uint8))

    def reduce_owned() -> None:
        ins = [
            _Packed(received[r * stride : r * stride + row], shard, fmt, compute)
            for r in range(world)
        ]
        owned = feedback.owned if feedback is not None else None
        out = _Packed(mine, shard, fmt, compute)
        total = padded
        for lo in range(0, shard, CHUNK):
            hi = min(lo + CHUNK, shard)
            blocks = total[: hi - lo].view(-1, BLOCK)
            for r in range(world):  # rank order: the same sum on any rank
                add_blocks(blocks, *ins[r].chunk(lo, hi), first=r == 0, fmt=fmt)
            if op == ReduceOp.MEAN:
                blocks.div_(world)
            err: torch.Tensor | None = None
            if owned is not None:
                blocks.add_(owned[lo:hi].view(-1, BLOCK))
                err = owned[lo:hi].view(-1, BLOCK)
            round_blocks(blocks, *out.slot(lo, hi), err, scratch[: hi - lo], fmt)
        for r in range(world):
            at = r * stride + row + row_pad
            exact_sum.add_(received[at : at + tail].view(compute))
        if op == ReduceOp.MEAN:
            exact_sum.div_(world)

    def write_result() -> None:
        flat = tensor.detach().reshape(-1)
        direct = flat.device.type == "cpu" and flat.data_ptr() == tensor.data_ptr()
        direct = direct and tensor.is_contiguous()
        result = flat if direct else torch.empty(tensor.numel(), dtype=compute)
        for j in range(world):
            part = _Packed(gathered[j * row : (j + 1) * row], shard, fmt, compute)
            for lo in range(j * shard, min((j + 1) * shard, numel), CHUNK):
                hi = min(lo + CHUNK, (j + 1) * shard)
                q, scales = part.chunk(lo - j * shard, hi - j * shard)
                if hi <= numel:
                    add_blocks(result[lo:hi].view(-1, BLOCK), q, scales, True, fmt)
                else:
                    staged = padded[: hi - lo].view(-1, BLOCK)
                    add_blocks(staged, q, scales, True, fmt)
                    result[lo:numel].copy_(staged.view(-1)[: numel - lo])
        result[numel:].copy_(exact_sum)
        if not direct:
            with torch.no_grad():
                tensor.copy_(result.view(tensor.shape))

    # The inputs are rounded from now on, in the background: a bucket queued
    # behind another (DDP's ``after``) is ready when its turn comes. A small
    # piece is rounded here, on the caller's thread, and reduced and written
    # on the event loop (INLINE_BELOW).
    small = numel <= INLINE_BELOW
    if small:
        rounding: Future[None] = Future()
        try:
            round_inputs()
            rounding.set_result(None)
        except Exception as exc:
            rounding.set_exception(exc)
    else:
        rounding = _ROUNDER.submit(round_inputs)

    async def run_work(work: Callable[[], None]) -> None:
        """On the event loop for a small piece, else on the executor."""
        if small:
            work()
        else:
            await asyncio.to_thread(work)

    async def run() -> torch.Tensor:
        # Both collectives run whatever happens here: a sequence number
        # taken must be used (a failed one fails the next at once).
        failed: BaseException | None = None
        try:
            await asyncio.wrap_future(rounding)
        except Exception as exc:
            send.zero_()
            failed = exc
        try:
            await exchange
        except BaseException:
            if feedback is not None:
                feedback.reset()
            with contextlib.suppress(Exception):
                await gather
            raise
        if failed is None:
            try:
                await run_work(reduce_owned)
            except Exception as exc:
                failed = exc
        if failed is not None:
            mine.zero_()
        try:
            await gather
        except BaseException:
            if feedback is not None:
                feedback.reset()
            raise
        if failed is not None:
            if feedback is not None:
                feedback.reset()
            raise failed
        await run_work(write_result)
        return tensor

    return run()
