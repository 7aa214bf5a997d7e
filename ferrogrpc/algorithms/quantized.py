"""int8 on the wire: blockwise-scaled quantization, the all-reduce built on
it, and the error feedback that DDP's ``compression="int8"`` carries.

[Note: int8 all-reduce]
A ring that adds int8 partial sums would round each partial sum again at
every hop: the error would grow with the world size, and no rank's input
would be rounded only once. This all-reduce rounds each value exactly
twice, whatever the world size:

1. Every rank rounds its own tensor ``v`` to int8 in blocks of ``BLOCK``
   elements, each block with its own float32 scale ``s = max|v_block| /
   127``. The tensor is cut into ``world_size`` shards (whole blocks).
2. An all-to-all sends shard j of every rank to rank j (int8 plus the
   scales: 1 + 4/BLOCK bytes per element).
3. Rank j dequantizes the ``world_size`` copies of its shard and adds them in
   rank order, in float32 (float64 for a float64 tensor), then divides by
   the world size for a mean.
4. Rank j rounds that sum to int8 blocks once more, and an all-gather gives
   every rank every shard, which every rank (rank j too) dequantizes. So
   every rank ends with bitwise identical values.

Bytes: each rank sends (n-1)/n of the tensor twice, at 1 + 4/BLOCK bytes an
element: about a quarter of a float32 ring's 2(n-1)/n x 4 bytes.

The bound. For an element in block b, with ``s_r`` rank r's scale of that
block in step 1 and ``s_out`` the owner's in step 4 (each the block's
largest magnitude / 127, rounding to nearest):

    |result - sum_r v_r| <= sum_r s_r / 2 + s_out / 2

(for a mean, the first term divided by the world size). That is at most
half of one int8 step of each input block, plus one of the result's.

Error feedback (``ErrorFeedback``, DDP's ``compression="int8"``): what
step 1 rounded away on this rank is added to the next call's input, and
what step 4 rounded away on the shard's owner to the next call's sum. No
rounding error is lost: over many steps the applied updates follow the
exact ones (the sum of what was sent equals the sum of the inputs, less
the error still carried, which stays within one step's bound). A change of
the world size (an elastic group's new epoch) changes the shards, and the
carried error starts again from zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Coroutine
from typing import Any, Protocol

import torch

from ..ops import ReduceOp

BLOCK = 256  # elements per scale
_QMAX = 127.0
_SCALE_BYTES = 4  # one float32 per block


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D float, a multiple of BLOCK elements) as int8 values and one
    float32 scale per block: ``x ~ q * scale``, rounding to nearest. An
    all-zero block has scale 0."""
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1).to(torch.float32) / _QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype)
    q = torch.round(blocks / safe[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q.view(-1), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``q * scale`` (blocks of BLOCK), in ``dtype``."""
    return (q.view(-1, BLOCK).to(dtype) * scale.to(dtype)[:, None]).view(-1)


def packed_bytes(elements: int) -> int:
    """Bytes of ``elements`` (a multiple of BLOCK) packed: int8 values, then
    the float32 scales."""
    return elements + (elements // BLOCK) * _SCALE_BYTES


def pack(q: torch.Tensor, scale: torch.Tensor, into: torch.Tensor) -> None:
    """Write int8 ``q`` and its float32 ``scale`` into the uint8 ``into``."""
    n = q.numel()
    into[:n].copy_(q.view(torch.uint8))
    into[n:].copy_(scale.contiguous().view(torch.uint8))


def unpack(packed: torch.Tensor, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 values and float32 scales that :func:`pack` wrote."""
    q = packed[:elements].view(torch.int8)
    scale = packed[elements:].clone().view(torch.float32)
    return q, scale


def shard_elements(numel: int, world: int) -> int:
    """Elements of each rank's shard: whole blocks, equal on every rank."""
    per = -(-numel // world)
    return max(BLOCK, -(-per // BLOCK) * BLOCK)


@dataclasses.dataclass
class ErrorFeedback:
    """The rounding error an int8 all-reduce carries to its next call on the
    same tensor (see [Note: int8 all-reduce]): ``sent``, this rank's input
    error (the padded tensor's length), and ``owned``, the error of the shard
    this rank owns. Empty until the first call; reset when the shape or the
    world size changes."""

    sent: torch.Tensor | None = None
    owned: torch.Tensor | None = None
    world: int = 0
    # The tensor's last ``exact`` elements travel unrounded, in its own
    # dtype, and carry no error (DDP's "had a gradient" flags): every rank
    # sends them to every rank, and each adds them in rank order.
    exact: int = 0

    def fits(self, padded: int, shard: int, world: int, like: torch.Tensor) -> None:
        """Start again from zero unless the last call had this layout."""
        if (
            self.sent is None
            or self.owned is None
            or self.world != world
            or self.sent.numel() != padded
            or self.owned.numel() != shard
            or self.sent.dtype != like.dtype
            or self.sent.device != like.device
        ):
            self.sent = torch.zeros(padded, dtype=like.dtype, device=like.device)
            self.owned = torch.zeros(shard, dtype=like.dtype, device=like.device)
            self.world = world

    def reset(self) -> None:
        self.sent = self.owned = None
        self.world = 0


class Collectives(Protocol):
    """What the int8 all-reduce needs of a rank's Peer."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_to_all_single(
        self, out: torch.Tensor, tensor: torch.Tensor
    ) -> Coroutine[Any, Any, torch.Tensor]: ...

    def all_gather_into_tensor(
        self, out: torch.Tensor, tensor: torch.Tensor
    ) -> Coroutine[Any, Any, torch.Tensor]: ...


def all_reduce_int8(
    peer: Collectives,
    tensor: torch.Tensor,
    op: ReduceOp,
    feedback: ErrorFeedback | None = None,
) -> Coroutine[Any, Any, torch.Tensor]:
    """The int8 all-reduce of [Note: int8 all-reduce], in place on ``tensor``
    (float32 or float64, SUM or MEAN; the caller checked). Its two
    collectives take their sequence numbers now, in call order, like any
    other; the rounding runs off the event loop. Returns ``tensor``."""
    world = peer.world_size
    exact = min(feedback.exact, tensor.numel()) if feedback is not None else 0
    numel = tensor.numel() - exact
    shard = shard_elements(numel, world)
    row = packed_bytes(shard)
    compute = tensor.dtype  # float32 or float64
    tail = exact * tensor.element_size()
    send = torch.empty(world * (row + tail), dtype=torch.uint8)
    received = torch.empty(world * (row + tail), dtype=torch.uint8)
    exact_sum = torch.zeros(exact, dtype=compute)
    gathered = torch.empty(world * row, dtype=torch.uint8)
    # This rank's block of the gather, written (by reduce_owned) before the
    # gather runs: a CPU gather works in place, and copies ``mine`` into
    # ``gathered`` when called, here onto itself.
    mine = gathered[peer.rank * row : (peer.rank + 1) * row]
    exchange = peer.all_to_all_single(received, send)
    gather = peer.all_gather_into_tensor(gathered, mine)

    def round_inputs() -> None:
        flat = torch.zeros(world * shard, dtype=compute, device=tensor.device)
        flat[:numel].copy_(tensor.detach().reshape(-1)[:numel])
        if feedback is not None:
            feedback.fits(world * shard, shard, world, flat)
            assert feedback.sent is not None
            flat += feedback.sent
        q, scale = quantize(flat)
        if feedback is not None:
            assert feedback.sent is not None
            torch.sub(flat, dequantize(q, scale, compute), out=feedback.sent)
        q, scale = q.cpu(), scale.cpu()
        unrounded = tensor.detach().reshape(-1)[numel:].cpu().contiguous().view(torch.uint8)
        per = shard // BLOCK
        for j in range(world):
            at = j * (row + tail)
            shard_q, shard_scale = q[j * shard : (j + 1) * shard], scale[j * per : (j + 1) * per]
            pack(shard_q, shard_scale, send[at : at + row])
            send[at + row : at + row + tail].copy_(unrounded)

    def reduce_owned() -> None:
        total = torch.zeros(shard, dtype=compute)
        for r in range(world):  # rank order: the same sum on any rank
            at = r * (row + tail)
            q, scale = unpack(received[at : at + row], shard)
            total += dequantize(q, scale, compute)
            exact_sum.add_(received[at + row : at + row + tail].clone().view(compute))
        if op == ReduceOp.MEAN:
            total /= world
            exact_sum.div_(world)
        if feedback is not None:
            assert feedback.owned is not None
            total += feedback.owned.cpu()
        q, scale = quantize(total)
        if feedback is not None:
            assert feedback.owned is not None
            feedback.owned.copy_(total - dequantize(q, scale, compute))
        pack(q, scale, mine)

    def write_result() -> None:
        out = torch.empty(world * shard, dtype=compute)  # (the padding is dropped)
        for j in range(world):
            q, scale = unpack(gathered[j * row : (j + 1) * row], shard)
            out[j * shard : (j + 1) * shard] = dequantize(q, scale, compute)
        result = torch.cat([out[:numel], exact_sum]).to(tensor.device)
        with torch.no_grad():
            tensor.copy_(result.view(tensor.shape))

    async def run() -> torch.Tensor:
        # Both collectives run whatever happens here: a sequence number
        # taken must be used (a failed one fails the next at once).
        failed: BaseException | None = None
        try:
            await asyncio.to_thread(round_inputs)
        except Exception as exc:
            send.zero_()
            failed = exc
        try:
            await exchange
        except BaseException:
            with contextlib.suppress(Exception):
                await gather
            raise
        if failed is None:
            try:
                await asyncio.to_thread(reduce_owned)
            except Exception as exc:
                failed = exc
        if failed is not None:
            mine.zero_()
        await gather
        if failed is not None:
            raise failed
        await asyncio.to_thread(write_result)
        return tensor

    return run()
