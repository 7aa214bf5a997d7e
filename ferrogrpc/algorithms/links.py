"""A rank's message links: one long-lived gRPC stream to each other rank,
opened on first use and kept, whose first message proves the sender (see
intake.py). Small collectives and point-to-point messages travel on them:
no new stream per message."""

from __future__ import annotations

import asyncio

from ..transport import wire
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
