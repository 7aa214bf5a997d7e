"""Helpers for tests and notebooks: N peers in the running event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

from .options import Timeouts
from .peer import Peer
from .rendezvous import LocalRendezvous
from .transport import GrpcTransport, MemoryTransport, Transport


@contextlib.asynccontextmanager
async def local_group(
    world_size: int,
    *,
    transport: Literal["grpc", "memory"] = "grpc",
    start_timeout: float = 30.0,
    **options: Any,
) -> AsyncIterator[list[Peer]]:
    """Start ``world_size`` peers in this loop on ephemeral loopback ports and
    yield them in rank order; close them all on exit.

    ``transport="memory"`` uses in-process queues instead of gRPC. Other
    keyword arguments go to :meth:`Peer.start` (``timeouts``,
    ``chunk_policy``, ``checksum``).
    """
    rendezvous = LocalRendezvous(world_size)
    registry: dict[str, MemoryTransport] = {}
    options.setdefault("timeouts", Timeouts(collective=60.0, idle=20.0, connect=20.0))

    def make() -> Transport:
        if transport == "memory":
            return MemoryTransport(registry)
        return GrpcTransport("127.0.0.1:0")

    async with asyncio.timeout(start_timeout):
        peers = await asyncio.gather(
            *(
                Peer.start(rank, world_size, rendezvous=rendezvous, transport=make(), **options)
                for rank in range(world_size)
            )
        )
    try:
        yield list(peers)
    finally:
        await asyncio.gather(*(peer.close() for peer in peers), return_exceptions=True)
