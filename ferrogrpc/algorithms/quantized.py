"""The int8 and int4 all-reduce: a tensor's blocks rounded (blocks.py) and
exchanged as an all-to-all and an all-gather, in pieces that pipeline, and
the error feedback that DDP's ``compression="int8"`` carries.

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
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import copy
import dataclasses
import os
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Final, Protocol

import torch

from ..errors import FerroGrpcError
from ..ops import INT4 as INT4_DTYPE
from ..ops import ReduceOp
from .blocks import (
    BLOCK,
    INT4,
    INT8,
    Format,
    Packed,
    add_blocks,
    packed_bytes,
    round_blocks,
    shard_elements,
)

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


# The wire dtypes of all_reduce that take this path.
FORMATS: Final = {torch.int8: INT8, INT4_DTYPE: INT4}


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
            out = Packed(send[j * stride : j * stride + row], shard, fmt, compute)
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
            Packed(received[r * stride : r * stride + row], shard, fmt, compute)
            for r in range(world)
        ]
        owned = feedback.owned if feedback is not None else None
        out = Packed(mine, shard, fmt, compute)
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
            part = Packed(gathered[j * row : (j + 1) * row], shard, fmt, compute)
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
