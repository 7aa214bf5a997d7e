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
from .descriptor import PROTOCOL, describe_mismatch
from .links import Links, check_part, send_parts
from .mailboxes import P2P_KEY, Mailbox


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

    def _next(self, direction: str, peer: int, tag: int) -> int:
        with self._lock:
            return self._counts.get((direction, peer, tag), 0)

    def _take_if(self, direction: str, peer: int, tag: int, n: int) -> bool:
        """Take number ``n`` if it is the next one (nothing took it meanwhile)."""
        key = (direction, peer, tag)
        with self._lock:
            if self._counts.get(key, 0) != n:
                return False
            self._counts[key] = n + 1
            return True

    async def recv_any(self, tensor: torch.Tensor, tag: int) -> int:
        """Receive into contiguous CPU ``tensor`` the next message with
        ``tag`` from whichever rank's arrives first; return that rank. Each
        rank's messages are still taken in its order: this takes the next
        one not yet claimed by a receive from that rank (a receive named
        for a rank, called meanwhile, claims it first)."""
        ctx, me = self.ctx, self.ctx.identity
        senders = [r for r in range(me.world_size) if r != me.rank]
        while True:
            # Each rank's next unclaimed message. A box made here and left
            # empty stays, for whichever receive takes that message later
            # (a receive named for that rank may already wait on it): at
            # most one per rank and tag.
            boxes: dict[int, tuple[int, Mailbox]] = {}
            for src in senders:
                n = self._next("recv", src, tag)
                boxes[src] = (n, ctx.mailboxes.get((P2P_KEY, tag, n, 0, src)))
            if not any(box.arrived.done() for _, box in boxes.values()):
                # No one rank to watch: the collective deadline bounds this.
                await asyncio.wait(
                    [box.arrived for _, box in boxes.values()],
                    return_when=asyncio.FIRST_COMPLETED,
                )
            for src, (n, box) in boxes.items():
                if box.arrived.done() and self._take_if("recv", src, tag, n):
                    await self.recv(tensor, src, tag, n)
                    return src

    def _descriptor(self, tensor: torch.Tensor) -> pb.Descriptor:
        return pb.Descriptor(
            kind=pb.P2P,
            dtype=DTYPE_TO_WIRE[tensor.dtype],  # type: ignore[arg-type]
            numel=tensor.numel(),
            world_size=self.ctx.identity.world_size,
            protocol=PROTOCOL,
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
            ctx.stats.received(src, item.nbytes)
