"""Two-level collectives: shared memory inside each host, gRPC rings across.

For a group that spans several hosts, some with several ranks (see
topology.py for the layout):

- **all_reduce**: a same-host reduce of the tensor's K slices (each local
  rank ends with its slices summed over its host, in place), then one gRPC
  ring per slice across the hosts, among that slice's owners (the K rings
  run at once, so a host's bytes cross the network on up to K streams, once
  per host rather than once per rank), then a same-host gather of the
  finished slices.
- **broadcast**: a gRPC chain across one representative per host (the root
  on its own host), then a same-host broadcast from each representative.
- **barrier**: an all_reduce of the barrier's token.
- **all_gather**: an all_reduce (sum) of the output viewed as integers, each
  rank's block filled and the rest zero: exact, bit for bit, for every
  dtype, at twice the bytes of a ring all_gather (a ``wire_dtype`` does not
  apply to it).
- **reduce_scatter**: an all_reduce of a copy of the input, of which each
  rank keeps its segment (the input itself is never written).

A host with one rank skips the same-host phases. MEAN sums everywhere and
divides once, by the world size, on each slice's owners.
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from ..failure.watchdog import Watchdog
from ..ops import DTYPE_TO_WIRE, OP_TO_WIRE, ReduceOp
from ..samehost.plane import LocalPlane
from ..samehost.topology import Topology
from ..v1 import collective_pb2 as pb
from . import schedule
from .context import RankContext
from .descriptor import build_plans
from .jobs import Job, JobTable
from .ring import LaneRunner
from .shm_rounds import LocalGroup, Partition

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class HierRunner:
    """Runs one collective of a multi-host group with shared memory inside
    hosts. ``plane`` is None on a host where this rank is alone."""

    def __init__(
        self,
        ctx: RankContext,
        jobs: JobTable,
        plane: LocalPlane | None,
        topology: Topology,
        job: Job,
    ) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.plane = plane
        self.topo = topology
        self.job = job
        me = ctx.identity
        self.me = me
        self.local = topology.local(me.rank)
        self.watch = Watchdog(me, ctx.transport, ctx.timeouts.idle, job.name, job.seq)
        self.group = (
            LocalGroup(me, plane, self.local, job, self.watch, ctx.stats)
            if plane is not None
            else None
        )

    async def run(self) -> None:
        job, ctx, plane = self.job, self.ctx, self.plane
        if plane is not None:
            await self.jobs.turn(job.seq)
        try:
            await self.watch.guard(self._main())
        except BaseException as exc:
            if plane is not None:
                cause = ctx.failure.cause(exc, job.name, job.seq, self.watch.first_failure)
                mid_round = self.group is not None and self.group.mid_round
                if not ctx.failure.plane_survives(cause, mid_round):
                    # A symptom (a neighbour's stream that ended) may only
                    # echo another rank's finding: the host's ranks get
                    # that finding too, once it is here (LocalPlane._fail).
                    ctx.failure.tell(cause, job.seq, plane.abort)
            raise

    async def _main(self) -> None:
        job = self.job
        if self.group is not None:
            await self.group.begin()
        kind, buf, stage = job.kind, job.buffer, job.stage
        n = buf.numel()
        if kind == pb.BROADCAST:
            if stage is not None and self.me.rank == job.descriptor.root:
                await stage.ready(0, n)
            await self._broadcast(buf, job.descriptor.root)
        elif kind == pb.ALL_GATHER:
            m = n // self.me.world_size
            lo, hi = self.me.rank * m, (self.me.rank + 1) * m
            if stage is not None:
                await stage.ready(lo, hi)
            buf[:lo].zero_()
            buf[hi:].zero_()
            ints = buf.view(_INT_VIEW[buf.element_size()])
            await self._all_reduce(ints, ReduceOp.SUM)
        elif kind == pb.REDUCE_SCATTER:
            assert job.out is not None
            if stage is not None:
                await stage.ready(0, n)
            work = buf.clone()
            await self._all_reduce(work, job.op, job.wire)
            job.out.copy_(work[job.out_offset : job.out_offset + job.out.numel()])
            if stage is not None:
                stage.final(job.out_offset, job.out_offset + job.out.numel())
            return
        else:  # ALL_REDUCE, BARRIER
            if stage is not None:
                await stage.ready(0, n)
            await self._all_reduce(buf, job.op, job.wire)
        if stage is not None:
            stage.final(0, n)

    def _sub_job(
        self,
        kind: int,
        buffer: torch.Tensor,
        op: ReduceOp,
        world: int,
        wire: torch.dtype | None = None,
    ) -> Job:
        """A slice's part of the job, as one ring across the hosts sees it."""
        desc = pb.Descriptor()
        desc.CopyFrom(self.job.descriptor)
        desc.kind = kind  # type: ignore[assignment]
        desc.numel = buffer.numel()
        desc.world_size = world
        desc.lanes = 1
        desc.root = 0
        desc.reduce_op = OP_TO_WIRE[op] if kind == pb.ALL_REDUCE else 0  # type: ignore[assignment]
        desc.wire_dtype = DTYPE_TO_WIRE[wire] if wire is not None else 0  # type: ignore[assignment]
        return dataclasses.replace(
            self.job,
            descriptor=desc,
            buffer=buffer,
            op=op,
            out=None,
            out_offset=0,
            stage=None,
            wire=wire,
        )

    async def _ring(
        self,
        k: int,
        members: list[int],
        view: torch.Tensor,
        op: ReduceOp,
        wire: torch.dtype | None,
        runners: list[LaneRunner],
    ) -> None:
        place = members.index(self.me.rank)
        sub = self._sub_job(pb.ALL_REDUCE, view, op, len(members), wire)
        plan = build_plans(sub.descriptor, place, len(members))[0]
        runner = LaneRunner(self.ctx, sub, k, plan, members)
        runners.append(runner)
        try:
            await runner.run()
        except Exception as exc:
            # The sibling rings are cancelled next: they tell their
            # neighbours this failure, not their own cancellation (failure/policy.py,
            # rule 4).
            for other in runners:
                if other is not runner and other.watch.first_failure is None:
                    other.watch.first_failure = exc
            raise

    async def _all_reduce(
        self, buf: torch.Tensor, op: ReduceOp, wire: torch.dtype | None = None
    ) -> None:
        topo, me = self.topo, self.me
        count = topo.slices
        slices = schedule.split_bounds(0, buf.numel(), count)
        owned = topo.owned(me.rank)
        local_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
        parts: Partition = [
            [slices[k] for k in range(count) if k % len(self.local) == i]
            for i in range(len(self.local))
        ]
        if self.group is not None:
            await self.group.reduce_phase(parts, buf, lambda lo, hi: buf[lo:hi], local_op)
        # A TaskGroup, so that one ring failing stops the others.
        runners: list[LaneRunner] = []
        async with asyncio.TaskGroup() as tg:
            for k in owned:
                members = topo.ring(k)
                lo, hi = slices[k]
                if len(members) > 1:
                    tg.create_task(self._ring(k, members, buf[lo:hi], local_op, wire, runners))
        if op is ReduceOp.MEAN:
            for k in owned:
                lo, hi = slices[k]
                buf[lo:hi].div_(me.world_size)
        if self.group is not None:
            await self.group.gather_phase(parts, buf)

    async def _broadcast(self, buf: torch.Tensor, root: int) -> None:
        topo, me = self.topo, self.me
        chain = topo.chain(root)
        if me.rank in chain and len(chain) > 1:
            sub = self._sub_job(pb.BROADCAST, buf, ReduceOp.SUM, len(chain))
            plan = build_plans(sub.descriptor, chain.index(me.rank), len(chain))[0]
            await LaneRunner(self.ctx, sub, 0, plan, chain).run()
        if self.group is not None:
            rep = topo.representative(topo.host_of[me.rank], root)
            parts: Partition = [[(0, buf.numel())] if r == rep else [] for r in self.local]
            await self.group.gather_phase(parts, buf)
