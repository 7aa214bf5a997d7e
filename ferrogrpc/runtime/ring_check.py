"""A joined rank's first collective: every rank reaches every other within
the connect timeout, by a barrier or by the all-gather of the TCP mesh's
ports that forms the mesh ([Note: the TCP mesh]); then the trace's clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Protocol

import torch

from ..algorithms.context import RankContext
from ..env import Settings
from ..errors import CollectiveTimeoutError
from ..observe import trace
from ..observe.observer import Observer
from ..transport.grpc_streams import GrpcTransport
from .direct_mesh import TcpMesh

log = logging.getLogger(__name__)


class Collectives(Protocol):
    """What the ring check needs of a rank's Peer."""

    def barrier(self) -> Awaitable[None]: ...

    def all_gather(self, tensor: torch.Tensor) -> Awaitable[list[torch.Tensor]]: ...


class DirectSlot(Protocol):
    """What the ring check needs of the rank's engine: its direct sockets
    (the same-host plane's, if any), and where a TCP mesh goes."""

    @property
    def direct(self) -> object | None: ...

    def attach_direct(self, sockets: TcpMesh) -> None: ...


async def check_ring(
    peer: Collectives,
    engine: DirectSlot,
    ctx: RankContext,
    observer: Observer,
    s: Settings,
    *,
    credentials: Sequence[str],
    shares_memory: bool,
    bind_host: str,
) -> TcpMesh | None:
    """Return once every rank reaches every other: the TCP mesh, formed and
    attached to ``engine``, where it fits (``s.direct``, no TLS, no direct
    sockets already, no two ranks sharing memory, a gRPC transport) and
    every rank reached it; else None (small collectives go over gRPC). Then,
    if the rank is traced (``observer``), its clock offset to rank 0. On the
    peer's loop, once its parts are open; a group of one returns at once.
    ``credentials``: every rank's, by rank (the mesh's handshake).

    Raises CollectiveTimeoutError if the ring does not form within the
    connect timeout; a mesh it made is closed then, as on any failure.
    """
    if ctx.identity.world_size == 1:
        return None
    timeout = s.timeouts.connect
    fits = (
        s.direct
        and s.tls is None
        and engine.direct is None
        and not shares_memory
        and isinstance(ctx.transport, GrpcTransport)
    )
    mesh: TcpMesh | None = None
    try:
        if fits:
            mesh = await _open_mesh(peer, engine, ctx, credentials, bind_host, timeout)
        else:
            await _reach(peer, ctx, timeout)
        if s.trace_dir:
            # Every rank can answer a ping now: the trace's clock offset.
            await trace.measure_clock(observer, ctx.transport, timeout)
    except BaseException:
        if mesh is not None:
            mesh.close()
        raise
    return mesh


async def _open_mesh(
    peer: Collectives,
    engine: DirectSlot,
    ctx: RankContext,
    credentials: Sequence[str],
    bind_host: str,
    timeout: float,
) -> TcpMesh | None:
    """Form the TCP mesh, or agree to go without it (None; see [Note: the TCP
    mesh]). The ports go round in the all-gather that checks the ring
    (instead of its barrier): no collective more."""
    me = ctx.identity
    mesh = TcpMesh(ctx, credentials)
    try:
        try:
            port = mesh.listen(bind_host)
        except OSError as exc:
            log.debug("rank %d: no TCP mesh listener: %r", me.rank, exc)
            port = 0
        ports = await _reach(peer, ctx, timeout, port)
        if min(ports) > 0 and await mesh.connect(ports):
            ctx.mailboxes.on_arrival = mesh.note_arrival
            engine.attach_direct(mesh)
            return mesh
    except BaseException:
        mesh.close()
        raise
    mesh.close()
    if me.rank == 0:
        log.warning(
            "ferrogrpc: the ranks could not all reach each other's TCP mesh port "
            "(a firewall that lets only the gRPC ports through?); small collectives "
            "go over gRPC instead. FERROGRPC_DIRECT=0 skips this attempt."
        )
    return None


async def _reach(
    peer: Collectives, ctx: RankContext, timeout: float, port: int | None = None
) -> list[int]:
    """A barrier (or, with ``port``, an all-gather of every rank's mesh
    port, returned) within ``timeout``: every rank reaches every other."""
    try:
        async with asyncio.timeout(timeout):
            if port is None:
                await peer.barrier()
                return []
            ports = await peer.all_gather(torch.tensor([port], dtype=torch.int64))
            return [int(p.item()) for p in ports]
    except TimeoutError as exc:
        raise ctx.identity.error(
            CollectiveTimeoutError, f"the ring did not form within {timeout:g}s"
        ) from exc
