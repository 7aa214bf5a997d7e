"""Point-to-point messages: ``send`` and ``recv`` between two ranks.

They are not collectives: only the two ranks take part, and they take no
sequence number of the group's. Instead the n-th send from rank a to rank b
with a tag matches b's n-th receive from a with that tag, as in
torch.distributed. A message travels on the sender's long-lived link to the
receiver (links.py's ``Links``), in parts of at most a chunk, each with the
message's descriptor (dtype, element count), its size and a checksum; the
receiver checks them against its own tensor and names the sender on any
difference.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from ..errors import ProtocolError
from ..failure.watchdog import Watchdog
from ..ops import DTYPE_TO_WIRE
from ..transport.wire import bytes_view
from ..v1 import collective_pb2 as pb
from .context import RankContext
from .descriptor import describe_mismatch
from .links import Links, check_part, send_parts
from .mailboxes import P2P_KEY


class PointToPoint:
    """This rank's point-to-point counters and operations."""

    def __init__(self, ctx: RankContext, links: Links, part_bytes: int) -> None:
        self.ctx = ctx
        self.links = links
        self.part_bytes = part_bytes
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int, int], int] = {}

    def take(self, direction: str, peer: int, tag: int) -> int:
        """The number of this message among those to (``"send"``) or from
        (``"recv"``) ``peer`` with ``tag``; taken when the call is made, on
        the caller's thread, so that call order is message order."""
        key = (direction, peer, tag)
        with self._lock:
            n = self._counts.get(key, 0)
            self._counts[key] = n + 1
        return n

    def _descriptor(self, tensor: torch.Tensor) -> pb.Descriptor:
        return pb.Descriptor(
            kind=pb.P2P,
            dtype=DTYPE_TO_WIRE[tensor.dtype],  # type: ignore[arg-type]
            numel=tensor.numel(),
            world_size=self.ctx.identity.world_size,
        )

    def _watch(self, name: str, n: int) -> Watchdog:
        ctx = self.ctx
        return Watchdog(ctx.identity, ctx.transport, ctx.timeouts.idle, name, n)

    def _part(self, tensor: torch.Tensor) -> int:
        size = tensor.element_size()
        return max(size, self.part_bytes // size * size)

    async def send(self, tensor: torch.Tensor, dst: int, tag: int, n: int) -> None:
        """Send contiguous CPU ``tensor`` as message ``n`` to ``dst``."""
        ctx = self.ctx
        header = pb.ChunkHeader(group=ctx.group, seq=n, src_rank=ctx.identity.rank, step=tag)
        header.kind = pb.P2P
        header.descriptor.CopyFrom(self._descriptor(tensor))
        watch = self._watch("send", n)
        await watch.guard(
            send_parts(ctx, self.links, watch, dst, header, bytes_view(tensor), self._part(tensor))
        )

    async def recv(self, tensor: torch.Tensor, src: int, tag: int, n: int) -> None:
        """Receive message ``n`` from ``src`` into contiguous CPU ``tensor``."""
        watch = self._watch("recv", n)
        await watch.guard(self._recv(watch, tensor, src, tag, n))

    async def _recv(
        self, watch: Watchdog, tensor: torch.Tensor, src: int, tag: int, n: int
    ) -> None:
        ctx, me = self.ctx, self.ctx.identity
        mine = self._descriptor(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        part = self._part(tensor)
        flat = tensor.view(-1).view(torch.uint8) if nbytes else tensor
        for index in range(max(1, -(-nbytes // part))):
            key = (P2P_KEY, tag, n, index, src)
            box = ctx.mailboxes.get(key)
            try:
                header, item = await watch.wait(
                    "recv", src, f"message {n} (tag {tag}) from", asyncio.shield(box.arrived)
                )
            finally:
                ctx.mailboxes.drop(key)
            assert isinstance(item, memoryview)
            mismatch = describe_mismatch(mine, header.descriptor, me.rank, src)
            if mismatch:
                raise me.error(ProtocolError, mismatch, op="recv", seq=n, peer=src)
            check_part(ctx, me, "recv", n, src, header, item)
            lo = index * part
            if item.nbytes:
                flat[lo : lo + item.nbytes].copy_(torch.frombuffer(item, dtype=torch.uint8))
            ctx.stats.bytes_received += item.nbytes
