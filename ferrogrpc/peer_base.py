"""The peer's plumbing: its parts, identity, jobs and life cycle.

:class:`PeerBase` holds what every collective of :class:`~ferrogrpc.peer.Peer`
uses: the lane context, the job table, the engine, the placement of tensors
on host buffers; ``_job`` numbers a collective, ``_run`` turns a placed job
into the coroutine a collective returns, ``close`` releases everything.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Self

import torch

from .context import RankContext
from .descriptor import make_descriptor
from .direct import DirectCall
from .engine import Engine
from .errors import ConfigError, PeerError
from .jobs import Job, JobTable
from .local import LocalPlane
from .ops import ReduceOp
from .options import ChunkPolicy
from .p2p import PointToPoint
from .placement import Placed, Placement
from .refusal import CallChecks
from .rendezvous import Rendezvous
from .topology import Topology
from .v1 import collective_pb2 as pb

# How long close() waits for abort notices still being delivered.
ABORT_DELIVERY_S = 2.0
# Descriptors kept for reuse (see PeerBase._job).
DESCRIPTORS_KEPT = 256


class PeerBase:
    """The parts of one rank; see :class:`~ferrogrpc.peer.Peer`."""

    def __init__(
        self,
        ctx: RankContext,
        jobs: JobTable,
        placement: Placement,
        chunk_policy: ChunkPolicy,
        rendezvous: Rendezvous,
        address: str,
        topology: Topology,
        plane: LocalPlane | None,
    ) -> None:
        """Use :meth:`start`."""
        self._ctx = ctx
        self._me = ctx.identity
        self._jobs = jobs
        self._failure = ctx.failure
        self._plane = plane
        self._engine = Engine(ctx, jobs, self._check_open, topology, plane)
        self._placement = placement
        self._policy = chunk_policy
        self._chunking = chunk_policy.resolve(self._me.world_size)
        self._p2p = PointToPoint(ctx, self._engine.links, self._chunking[0])
        self._rendezvous = rendezvous
        self._address = address
        self._closed = False
        self._descriptors: dict[tuple[Any, ...], pb.Descriptor] = {}
        # Argument checks; a refused call still takes its seq (refusal.py).
        self._checks = CallChecks(jobs, self._failure, self._engine, lambda: self._closed).run

    # ---------------------------------------------------------------- setup

    @property
    def rank(self) -> int:
        return self._me.rank

    @property
    def world_size(self) -> int:
        return self._me.world_size

    @property
    def address(self) -> str:
        """The address this rank advertises to the others."""
        return self._address

    @property
    def data_path(self) -> str:
        """How this rank's tensor bytes travel: ``"shared memory"`` (every
        rank on this host), ``"two-level"`` (shared memory inside hosts, gRPC
        across), or ``"grpc"``."""
        topo = self._engine.topology
        if self._plane is not None and topo.single_host:
            return "shared memory"
        if topo.shares_memory and not topo.single_host:
            return "two-level"
        return "grpc"

    # ------------------------------------------------------------- plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise self._me.error(ConfigError, "this peer is closed")
        self._failure.check()

    def _job(
        self,
        kind: int,
        name: str,
        buffer: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        root: int = 0,
        out: torch.Tensor | None = None,
        out_offset: int = 0,
        wire: torch.dtype | None = None,
    ) -> Job:
        # The same call on the same shapes has the same descriptor (never
        # changed once made): built once, it costs a small collective less.
        key = (kind, buffer.dtype, buffer.numel(), op, root, wire)
        descriptor = self._descriptors.get(key)
        if descriptor is None:
            if len(self._descriptors) >= DESCRIPTORS_KEPT:
                self._descriptors.clear()
            descriptor = self._descriptors[key] = make_descriptor(
                kind,
                buffer,
                op,
                root,
                self._me.world_size,
                self._chunking,
                self._policy.lane_min_bytes,
                self._ctx.checksum,
                wire,
            )
        itemsize = buffer.element_size()
        ordered = self._engine.uses_plane(descriptor, itemsize)
        direct = self._engine.uses_direct(descriptor, itemsize)
        return self._jobs.add(
            name, descriptor, buffer, op, out, out_offset, ordered, wire, direct=direct
        )

    def _run(self, placed: Placed, result: Any) -> Coroutine[Any, Any, Any]:
        """The coroutine that runs ``placed``'s job (a group of one runs no
        ring; a reduce-scatter there is a copy) and returns ``result``."""
        job = placed.job

        async def run() -> Any:
            if self._me.world_size > 1:
                await self._engine.execute(job)
            else:
                self._check_open()
                if job.out is not None:
                    job.out.copy_(job.buffer)
            placed.after()
            return result

        if not job.direct or job.stage is not None:
            return run()

        def now() -> tuple[bool, Any]:
            # A synchronous caller runs it in its own thread, if it is its turn.
            if not self._jobs.direct_head(job.seq):
                return False, None
            self._engine.run_now(job)
            placed.after()
            return True, result

        return DirectCall(run(), now)

    # ---------------------------------------------------------- collectives

    async def close(self) -> None:
        """Stop serving and close every connection. Idempotent. Running
        collectives fail with PeerError."""
        if self._closed:
            return
        self._closed = True
        closed = "the peer was closed while this collective ran"
        self._jobs.cancel_all(lambda j: self._me.error(PeerError, closed, op=j.name, seq=j.seq))
        await self._failure.drain(ABORT_DELIVERY_S)
        await self._engine.links.close()
        self._engine.close()
        if self._plane is not None:
            await self._plane.close()
        await self._ctx.transport.close()
        await self._rendezvous.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
