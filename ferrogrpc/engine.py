"""The engine: runs one collective's lanes under its deadline, and hands a
failure to the failure policy to decide what it raises."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from .context import RankContext
from .descriptor import build_plans
from .direct import DeadlinePassedError, Direct, is_direct
from .errors import FerroGrpcError, PeerError
from .hierarchy import HierRunner
from .jobs import Job, JobTable
from .lane import LaneRunner
from .links import Links
from .local import LocalPlane
from .localalgo import LocalRunner
from .small import SmallRunner, is_small
from .topology import Topology
from .v1 import collective_pb2 as pb


class Engine:
    """Executes jobs on one rank. ``ctx`` is what every lane gets; ``jobs``
    the table the jobs were numbered in; ``check_open()`` raises when the
    rank can run no more collectives (closed, or broken)."""

    def __init__(
        self,
        ctx: RankContext,
        jobs: JobTable,
        check_open: Callable[[], None],
        topology: Topology | None = None,
        plane: LocalPlane | None = None,
    ) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self._check_open = check_open
        self.topology = topology or Topology.flat(ctx.identity.world_size)
        self.plane = plane
        self.links = Links(ctx)
        # All-gathers and reduce-scatters are small by one rank's part, except
        # where several hosts hold several ranks each (small.is_small).
        topo = self.topology
        self._by_part = topo.single_host or not topo.shares_memory
        # Small collectives run on direct sockets when every rank is on this host.
        self.direct: Direct | None = None
        if plane is not None and self.topology.single_host and ctx.identity.world_size > 1:
            self.direct = Direct(ctx, plane, check_open, asyncio.get_running_loop())
            jobs.wake = plane.wake

    def uses_direct(self, descriptor: pb.Descriptor, itemsize: int) -> bool:
        """Whether a collective runs on the direct sockets (direct.py)."""
        return self.direct is not None and is_direct(descriptor, itemsize)

    def uses_plane(self, descriptor: pb.Descriptor, itemsize: int) -> bool:
        """Whether a collective would go through this rank's shared segments,
        which collectives take in turns (JobTable.turn)."""
        if descriptor.kind == pb.ALL_TO_ALL:
            return False
        return self.plane is not None and not self._small(descriptor, itemsize)

    def _small(self, descriptor: pb.Descriptor, itemsize: int) -> bool:
        return is_small(descriptor, itemsize, by_part=self._by_part)

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()

    def _runner(self, job: Job) -> tuple[Callable[[], Coroutine[Any, Any, None]], bool]:
        """How ``job`` runs: in one exchange if it is small; among one host's
        ranks through shared memory; in two levels when several hosts have
        several ranks; else as rings over the transport. Every rank picks
        alike: the topology is the same everywhere. Also whether it runs in
        the caller's task (a small exchange without staging) rather than a
        task of its own."""
        me, topo = self.ctx.identity, self.topology
        if job.direct:
            return (lambda: self._run_direct(job)), False
        if job.kind == pb.ALL_TO_ALL or self._small(job.descriptor, job.buffer.element_size()):
            runner = SmallRunner(self.ctx, self.links, self.plane, topo.local(me.rank), job)
            return runner.run, job.stage is None
        if self.plane is not None and topo.single_host:
            return LocalRunner(self.ctx, self.jobs, self.plane, topo.local(me.rank), job).run, False
        if topo.shares_memory and not topo.single_host:
            return HierRunner(self.ctx, self.jobs, self.plane, topo, job).run, False
        plans = build_plans(job.descriptor, me.rank, me.world_size)
        runners = [LaneRunner(self.ctx, job, lane, plan) for lane, plan in enumerate(plans)]
        return (lambda: _run_all(runners)), False

    async def execute(self, job: Job) -> None:
        """Run ``job`` to completion; raise what the failure policy decides
        if it fails. The job leaves the table either way. It first raises if
        the rank closed or broke since the job took its sequence number (a
        chained DDP bucket behind a failed one)."""
        try:
            self._check_open()
        except FerroGrpcError:
            await self._release(job)
            raise
        refusal = self.ctx.failure.refusal(job.name, job.seq)
        if refusal is not None:  # some rank refused it before it started here
            await self._release(job)
            raise refusal
        try:
            await self._supervise(job, *self._runner(job))
        finally:
            await self._release(job)
            self.ctx.stats.collectives += 1

    async def _run_direct(self, job: Job) -> None:
        """A direct job from the loop: in its turn, in the direct thread."""
        direct = self.direct
        assert direct is not None and self.plane is not None
        stage = job.stage
        if stage is not None:
            await stage.ready(0, job.buffer.numel())
        await self.jobs.direct_turn(job.seq)
        running = asyncio.get_running_loop().run_in_executor(direct.pool, direct.run, job)
        try:
            done = await asyncio.shield(running)
        except asyncio.CancelledError:
            # Stopped from the loop (a report, close(), the deadline): the
            # thread must stop too before the next direct job may run.
            job.stopped = job.error or self.ctx.identity.error(
                PeerError, "the collective was stopped", op=job.name, seq=job.seq
            )
            self.plane.wake()
            await asyncio.wait([running])
            raise
        except DeadlinePassedError:
            raise self._direct_deadline(job) from None
        except FerroGrpcError as exc:
            self._abort_plane(exc, job)
            raise
        if stage is not None:
            stage.final(*done)

    def run_now(self, job: Job) -> None:
        """Run direct job ``job`` in this (the caller's) thread; it must be
        its turn (JobTable.direct_head). Raises what the loop's path would:
        the failure policy decides, on the loop."""
        direct = self.direct
        assert direct is not None and job.stage is None
        try:
            self._check_open()
            refusal = self.ctx.failure.refusal(job.name, job.seq)
            if refusal is not None:
                raise refusal
            try:
                direct.run(job)
            except DeadlinePassedError:
                raise direct.on_loop(self._deadline(job)) from None
            except FerroGrpcError as exc:
                raise direct.on_loop(self._settle_direct(exc, job)) from exc.__cause__
        finally:
            self.jobs.finish(job)
            refused = self.jobs.refused(job.seq)
            if refused is not None:
                direct.loop.call_soon_threadsafe(self._forget, job.seq, refused)
            self.ctx.stats.collectives += 1

    def _direct_deadline(self, job: Job) -> FerroGrpcError:
        """Direct job ``job`` missed its deadline: break, tell the host's
        ranks, and return the error to raise. On the loop."""
        failure = self.ctx.failure
        err = failure.deadline_passed(job.name, job.seq, self.ctx.timeouts.collective)
        assert self.plane is not None
        self.plane.abort(failure.abort_message(err))
        return err

    def _abort_plane(self, exc: FerroGrpcError, job: Job) -> None:
        """Tell the host's ranks why direct job ``job`` failed here, unless
        the plane survives that (a refusal). On the loop."""
        failure = self.ctx.failure
        cause = failure.cause(exc, job.name, job.seq)
        assert self.plane is not None
        if not failure.plane_survives(cause, mid_round=False):
            self.plane.abort(failure.abort_message(cause))

    async def _deadline(self, job: Job) -> FerroGrpcError:
        return self._direct_deadline(job)

    async def _settle_direct(self, exc: FerroGrpcError, job: Job) -> FerroGrpcError:
        self._abort_plane(exc, job)
        return await self.ctx.failure.settle(exc, job.name, job.seq)

    async def point_to_point(self, job: Job, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run a send or receive (``job`` names it; it takes no sequence
        number) under the same deadline and failure policy as a collective."""
        self._check_open()
        self.jobs.track(job)
        try:
            await self._supervise(job, run)
        finally:
            self.jobs.untrack(job)

    async def _supervise(
        self, job: Job, run: Callable[[], Coroutine[Any, Any, None]], here: bool = False
    ) -> None:
        """Run ``run()`` under the deadline, in a task of its own, or with
        ``here`` in this one (one task less: a small collective's latency);
        either way that task is what ``job.cancel()`` cancels."""
        ctx = self.ctx
        failure = ctx.failure
        work: Awaitable[None]
        if here:
            job.task = asyncio.current_task()
            work = run()
        else:
            job.task = work = asyncio.ensure_future(run())
        deadline_s = ctx.timeouts.collective
        try:
            async with asyncio.timeout(deadline_s) as deadline:
                try:
                    await work
                finally:
                    if here:
                        job.task = None  # this task goes on: cancel it no more
                if job.stage is not None:
                    await job.stage.finish()
        except asyncio.CancelledError:
            if job.error is not None:
                if here:
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                raise job.error from None
            raise
        except TimeoutError as exc:
            if isinstance(exc, FerroGrpcError) or not deadline.expired():
                raise
            raise failure.deadline_passed(job.name, job.seq, deadline_s) from None
        except FerroGrpcError as exc:
            raise await failure.settle(exc, job.name, job.seq) from exc.__cause__
        except BaseExceptionGroup as group:
            err = _first_ferro(group) or ctx.identity.error(
                PeerError, f"internal failure: {group!r}", op=job.name, seq=job.seq
            )
            raise await failure.settle(err, job.name, job.seq) from group

    async def _release(self, job: Job) -> None:
        if job.stage is not None and not job.stage.finished:
            await job.stage.abandon()
        self.jobs.finish(job)
        refusal = self.jobs.refused(job.seq)
        if refusal is not None:
            self._forget(job.seq, refusal)

    def refused(self, errors: Sequence[FerroGrpcError]) -> None:
        """This rank refused these collectives (its own argument checks
        failed; the job table already numbered them): tell every rank, and
        drop what arrives for them. On the loop."""
        for err in errors:
            assert err.seq is not None
            self._forget(err.seq, err)
            self.ctx.failure.tell_refusal(err)

    def _forget(self, seq: int, err: FerroGrpcError) -> None:
        self.ctx.mailboxes.drop_seq(self.ctx.group, seq, err)
        if self.plane is not None:
            self.plane.forget(seq)


async def _run_all(runners: list[LaneRunner]) -> None:
    if len(runners) == 1:
        await runners[0].run()
        return
    async with asyncio.TaskGroup() as tg:
        for runner in runners:
            tg.create_task(runner.run())


def _first_ferro(group: BaseExceptionGroup[BaseException]) -> FerroGrpcError | None:
    for exc in group.exceptions:
        if isinstance(exc, FerroGrpcError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_ferro(exc)
            if found is not None:
                return found
    return None
