"""A rank's message links: one long-lived gRPC stream to each other rank,
opened on first use and kept, whose first message proves the sender (see
intake.py). Small collectives and point-to-point messages travel on them:
no new stream per message. A message goes in parts of at most a chunk
(:func:`send_parts`), each checked on arrival (:func:`check_part`)."""

from __future__ import annotations

import asyncio

from ..errors import Identity, ProtocolError
from ..failure.watchdog import Watchdog
from ..transport import integrity, wire
from ..transport.streams import OutStream
from ..v1 import collective_pb2 as pb
from .context import RankContext


class Links:
    """This rank's long-lived message links to other ranks over the
    transport: one stream each, opened on first use and kept, whose first
    message proves the sender (see intake.py)."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self._streams: dict[int, OutStream] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def send(self, dst: int, message: bytes) -> None:
        lock = self._locks.get(dst)
        if lock is None:
            lock = self._locks[dst] = asyncio.Lock()
        async with lock:  # one write at a time per stream
            stream = self._streams.get(dst)
            if stream is None:
                ctx = self.ctx
                stream = await ctx.transport.open(dst, 0)
                hello = pb.ChunkHeader(
                    group=ctx.group, kind=pb.LINK, src_rank=ctx.identity.rank, nonce=ctx.nonce
                )
                hello.descriptor.kind = pb.LINK
                await stream.write(wire.encode(hello))
                self._streams[dst] = stream
            try:
                await stream.write(message)
            except BaseException:
                self._streams.pop(dst, None)
                stream.cancel()
                raise

    async def close(self, grace: float = 2.0) -> None:
        """End every link, letting messages already written arrive first
        (a peer may still need this rank's last one), for up to ``grace``."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            try:
                async with asyncio.timeout(grace):
                    await stream.close()
            except Exception:
                pass  # best effort: the peer may be gone or failing
            finally:
                stream.cancel()


async def send_parts(
    ctx: RankContext,
    links: Links,
    watch: Watchdog,
    dst: int,
    header: pb.ChunkHeader,
    view: memoryview,
    part: int,
) -> None:
    """Send ``view`` to ``dst`` on its link, in parts of at most ``part``
    bytes: each with ``header`` (its lane the part's index, its offset the
    whole message's size) and, when enabled, the part's checksum."""
    total = view.nbytes
    header.offset = total
    for index, lo in enumerate(range(0, max(total, 1), part)):
        piece = view[lo : lo + part]
        header.lane = index
        if ctx.checksum is not None:
            header.checksum = ctx.checksum(piece)
            header.has_checksum = True
        await watch.wait(
            f"s{dst}",
            dst,
            "a message to be accepted by",
            links.send(dst, wire.encode(header, piece)),
        )
    ctx.stats.sent(dst, total)


def check_part(
    ctx: RankContext,
    me: Identity,
    op: str,
    seq: int,
    src: int,
    header: pb.ChunkHeader,
    item: memoryview,
) -> None:
    """Raise ProtocolError naming ``src`` if a received part fails its checksum."""
    checksum = ctx.checksum
    if checksum is not None and (not header.has_checksum or checksum(item) != header.checksum):
        raise me.error(
            ProtocolError,
            f"the message from rank {src} ({me.address_of(src)}) failed its "
            f"{integrity.checksum_name(checksum)} check: corrupted in flight; it was discarded",
            op=op,
            seq=seq,
            peer=src,
        )
