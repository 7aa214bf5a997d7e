"""The engine: the one path every collective takes on a rank.

[Note: one path per collective] A collective is numbered when it is called
(:meth:`Engine.number`, on the caller's thread), and then run by one entry
wherever it runs: awaited on the loop (:meth:`Engine.run`) or, a small
collective on one host whose turn it is, in the caller's own thread
(:meth:`Engine.run_here`). Both apply the same rules, each written once:
:meth:`Engine._admit` (the open check and the refusal) before, and
:meth:`Engine._retire` (finishing, forgetting a refused collective's
arrivals, the count) after. Between them :meth:`Engine._runner` picks how
the job runs (one exchange, the direct sockets, shared memory, two levels,
or rings), and the deadline and the failure policy decide what a failure
raises.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import torch

from ..algorithms.context import RankContext
from ..algorithms.descriptor import build_plans, make_descriptor
from ..algorithms.direct import DeadlinePassedError, Direct, DirectSockets, is_direct
from ..algorithms.exchange_plan import is_small
from ..algorithms.jobs import Job, JobTable
from ..algorithms.links import Links
from ..algorithms.one_exchange import SmallRunner
from ..algorithms.ring import LaneRunner
from ..algorithms.shm_rounds import LocalRunner
from ..algorithms.two_level import HierRunner
from ..errors import FerroGrpcError, PeerError
from ..lifecycle import Lifecycle
from ..observe.observer import Observer
from ..ops import ReduceOp
from ..options import ChunkPolicy
from ..samehost.plane import LocalPlane
from ..samehost.topology import Topology
from ..v1 import collective_pb2 as pb

# Descriptors kept for reuse (see Engine.number).
DESCRIPTORS_KEPT = 256


class Engine:
    """Numbers and runs the jobs of one rank (see [Note: one path per
    collective]). ``ctx`` is what every algorithm gets; ``jobs`` the table
    the jobs are numbered in; ``life`` the peer's lifecycle, which says
    whether the rank can run collectives at all."""

    def __init__(
        self,
        ctx: RankContext,
        jobs: JobTable,
        life: Lifecycle,
        chunk_policy: ChunkPolicy,
        topology: Topology | None = None,
        plane: LocalPlane | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.ctx = ctx
        me = ctx.identity
        self.observer = observer or Observer(me)
        # Whom a collective exchanges with, by how it runs: a ring's
        # neighbours, or every other rank.
        self._ring_peers = tuple(
            sorted({(me.rank - 1) % me.world_size, (me.rank + 1) % me.world_size} - {me.rank})
        )
        self._all_peers = tuple(r for r in range(me.world_size) if r != me.rank)
        self.jobs = jobs
        self.life = life
        self._policy = chunk_policy
        self._chunking = chunk_policy.resolve(ctx.identity.world_size)
        self.topology = topology or Topology.flat(ctx.identity.world_size)
        # Across hosts, with the default chunk size: chunks cut for the link
        # ([Note: chunks on a link] in algorithms/schedule.py). Every rank
        # decides alike: the addresses are the same everywhere. Ranks that
        # all advertise loopback share one host, shared memory or not.
        self._link = chunk_policy.chunk_bytes is None and not all(
            _loopback(a) for a in ctx.identity.addresses
        )
        self.plane = plane
        self.links = Links(ctx)
        self._loop = asyncio.get_running_loop()
        self._descriptors: dict[tuple[Any, ...], pb.Descriptor] = {}
        # Where the caller's training is (descriptor.make_stamp; 0: not
        # said): every collective numbered meanwhile carries it, and ranks
        # whose stamps differ fail it instead of mixing their data.
        self.stamp = 0
        # All-gathers and reduce-scatters are small by one rank's part, except
        # where several hosts hold several ranks each (exchange_plan.is_small).
        topo = self.topology
        self._by_part = topo.single_host or not topo.shares_memory
        # Small collectives run on direct sockets when every rank is on this host.
        self.direct: Direct | None = None
        self._sockets: DirectSockets | None = None
        if plane is not None and self.topology.single_host and ctx.identity.world_size > 1:
            self.attach_direct(plane)

    def attach_direct(self, sockets: DirectSockets) -> None:
        """Run small collectives on ``sockets`` from now on (the same-host
        plane's, or the TCP mesh). Every rank attaches the same kind at the
        same point of its call order: before it numbers its next collective."""
        self._sockets = sockets
        self.direct = Direct(self.ctx, sockets, self.life.check, self._loop)
        self.jobs.wake = sockets.wake

    @property
    def chunk_bytes(self) -> int:
        """The chunk size this rank's gRPC messages are cut to."""
        return self._chunking[0]

    @property
    def data_path(self) -> str:
        """``"shared memory"``, ``"two-level"`` or ``"grpc"``."""
        topo = self.topology
        if self._host_plane is not None:
            return "shared memory"
        if topo.shares_memory and not topo.single_host:
            return "two-level"
        return "grpc"

    def check_open(self) -> None:
        """Raise if this rank can run no more collectives (closed, or broken)."""
        self.life.check()

    # ------------------------------------------------------------ numbering

    def number(
        self,
        kind: int,
        name: str,
        buffer: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        root: int = 0,
        out: torch.Tensor | None = None,
        out_offset: int = 0,
        wire: torch.dtype | None = None,
        uniform: bool = False,
    ) -> Job:
        """A new job over ``buffer`` with the next sequence number, taken now
        (on the caller's thread: call order is the order on every rank).
        ``uniform``: an all_to_all whose every rank sends every rank an
        equal part of a buffer of one size (make_descriptor)."""
        # The same call on the same shapes has the same descriptor (never
        # changed once made): built once, it costs a small collective less.
        key = (kind, buffer.dtype, buffer.numel(), op, root, wire, uniform)
        descriptor = self._descriptors.get(key)
        if descriptor is None:
            if len(self._descriptors) >= DESCRIPTORS_KEPT:
                self._descriptors.clear()
            descriptor = self._descriptors[key] = make_descriptor(
                kind,
                buffer,
                op,
                root,
                self.ctx.identity.world_size,
                self._chunking,
                self._policy.lane_min_bytes,
                self.ctx.checksum,
                wire,
                self._link,
                uniform,
            )
        if self.stamp:
            stamped = pb.Descriptor()
            stamped.CopyFrom(descriptor)
            stamped.stamp = self.stamp
            descriptor = stamped
        itemsize = buffer.element_size()
        direct = self.direct is not None and is_direct(descriptor, itemsize)
        # (A direct job never touches the segments: a small uniform
        # all_to_all on one host, say.)
        ordered = not direct and self._uses_plane(descriptor, itemsize)
        job = self.jobs.add(
            name, descriptor, buffer, op, out, out_offset, ordered, wire, direct=direct
        )
        job.entry = self.observer.called(job.seq, name, buffer.nbytes, _dtype_name(buffer.dtype))
        return job

    @property
    def _host_plane(self) -> LocalPlane | None:
        """The same-host plane where one host holds the whole group."""
        return self.plane if self.topology.single_host else None

    def _uses_plane(self, descriptor: pb.Descriptor, itemsize: int) -> bool:
        """Whether a collective would go through this rank's shared segments,
        which collectives take in turns (JobTable.turn)."""
        if descriptor.kind == pb.ALL_TO_ALL:
            return self._host_plane is not None
        return self.plane is not None and not self._small(descriptor, itemsize)

    def _small(self, descriptor: pb.Descriptor, itemsize: int) -> bool:
        return is_small(descriptor, itemsize, by_part=self._by_part)

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()

    # -------------------------------------------------------------- the rules

    def _admit(self, job: Job) -> None:
        """Before a job runs: it raises if the rank closed or broke since it
        took its sequence number (a chained DDP bucket behind a failed one),
        or if some rank refused it before it started here."""
        self.check_open()
        refusal = self.ctx.failure.refusal(job.name, job.seq)
        if refusal is not None:
            raise refusal

    def _retire(self, job: Job, error: BaseException | None) -> None:
        """After a job ran, failed (``error``) or was refused, wherever it
        ran: it leaves the table; what still arrives for a refused one is
        dropped (on the loop); it is counted, and the observer told."""
        if job.entry is not None:
            self.observer.ended(job.entry, error)
        self.jobs.finish(job)
        refusal = self.jobs.refused(job.seq)
        if refusal is not None:
            if _running_loop() is self._loop:
                self._forget(job.seq, refusal)
            else:
                self._loop.call_soon_threadsafe(self._forget, job.seq, refusal)
        self.ctx.stats.collectives += 1

    # ---------------------------------------------------------- where it runs

    async def run(self, job: Job) -> None:
        """Run ``job`` to completion on the loop; raise what the failure policy
        decides if it fails. A group of one runs no algorithm (a
        reduce-scatter or an all-to-all there is a copy)."""
        if self.ctx.identity.world_size == 1:
            self.check_open()
            if job.out is not None:
                job.out.copy_(job.buffer)
            if job.entry is not None:
                self.observer.started(job.entry, "alone", ())
                self.observer.ended(job.entry, None)
            return
        error: BaseException | None = None
        try:
            self._admit(job)
            await self._supervise(job, *self._runner(job))
        except BaseException as exc:
            error = exc
            raise
        finally:
            if job.stage is not None and not job.stage.finished:
                await job.stage.abandon()
            self._retire(job, error)

    def run_here(self, job: Job) -> bool:
        """Run ``job`` in this (the caller's) thread if it is a direct job
        without staging and its turn has come (JobTable.direct_head); False
        (nothing done) otherwise. Raises what the loop's path would: the
        failure policy decides, on the loop."""
        direct = self.direct
        if direct is None or not job.direct or job.stage is not None:
            return False
        if not self.jobs.direct_head(job.seq):
            return False
        error: BaseException | None = None
        try:
            self._admit(job)
            self._started(job, "direct", self._all_peers)
            job.begin(None)
            try:
                direct.run(job)
            except DeadlinePassedError:
                raise direct.on_loop(self._deadline(job)) from None
            except FerroGrpcError as exc:
                raise direct.on_loop(self._settle_direct(exc, job)) from exc.__cause__
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._retire(job, error)
        return True

    def _started(self, job: Job, path: str, peers: tuple[int, ...]) -> None:
        if job.entry is not None:
            self.observer.started(job.entry, path, peers)

    def _runner(self, job: Job) -> tuple[Callable[[], Coroutine[Any, Any, None]], bool]:
        """How ``job`` runs on the loop: on the direct sockets in the direct
        thread; in one exchange if it is small (an all_to_all: unless one
        host holds the group); among one host's ranks
        through shared memory; in two levels when several hosts have several
        ranks; else as rings over the transport. Every rank picks alike: the
        topology is the same everywhere. Also whether it runs in the
        caller's task (a small exchange without staging) rather than a task
        of its own."""
        me, topo = self.ctx.identity, self.topology
        if job.direct:
            self._started(job, "direct", self._all_peers)
            return (lambda: self._run_direct(job)), False
        plane = self._host_plane
        # (An all_to_all's small pieces travel in its first message there:
        # shm_rounds.LocalGroup.all_to_all.)
        if (job.kind == pb.ALL_TO_ALL and plane is None) or (
            job.kind != pb.ALL_TO_ALL and self._small(job.descriptor, job.buffer.element_size())
        ):
            self._started(job, "one exchange", self._all_peers)
            runner = SmallRunner(self.ctx, self.links, self.plane, topo.local(me.rank), job)
            return runner.run, job.stage is None
        if plane is not None:
            self._started(job, "shared memory", self._all_peers)
            return LocalRunner(self.ctx, self.jobs, plane, topo.local(me.rank), job).run, False
        if topo.shares_memory and not topo.single_host:
            self._started(job, "two-level", self._all_peers)
            return HierRunner(self.ctx, self.jobs, self.plane, topo, job).run, False
        self._started(job, "ring", self._ring_peers)
        plans = build_plans(job.descriptor, me.rank, me.world_size)
        runners = [LaneRunner(self.ctx, job, lane, plan) for lane, plan in enumerate(plans)]
        return (lambda: _run_all(runners)), False

    async def _run_direct(self, job: Job) -> None:
        """A direct job from the loop: in its turn, in the direct thread."""
        direct, sockets = self.direct, self._sockets
        assert direct is not None and sockets is not None
        stage = job.stage
        if stage is not None:
            await stage.ready(0, job.buffer.numel())
        await self.jobs.direct_turn(job.seq)
        running = self._loop.run_in_executor(direct.pool, direct.run, job)
        try:
            done = await asyncio.shield(running)
        except asyncio.CancelledError:
            # Stopped from the loop (a report, close(), the deadline): the
            # thread must stop too before the next direct job may run.
            job.stop(
                job.error
                or self.ctx.identity.error(
                    PeerError, "the collective was stopped", op=job.name, seq=job.seq
                )
            )
            sockets.wake()
            await asyncio.wait([running])
            if not running.cancelled():
                running.exception()  # it raised what it was stopped for: seen
            raise
        except DeadlinePassedError:
            raise self._direct_deadline(job) from None
        except FerroGrpcError as exc:
            self._abort_plane(exc, job)
            raise
        if stage is not None:
            stage.final(*done)

    def _direct_deadline(self, job: Job) -> FerroGrpcError:
        """Direct job ``job`` missed its deadline: break, tell the ranks the
        direct sockets reach, and return the error to raise. On the loop."""
        failure = self.ctx.failure
        err = failure.deadline_passed(job.name, job.seq, self.ctx.timeouts.collective)
        assert self._sockets is not None
        self._sockets.abort(failure.abort_message(err))
        return err

    def _abort_plane(self, exc: FerroGrpcError, job: Job) -> None:
        """Tell the ranks the direct sockets reach why direct job ``job``
        failed here, unless the plane survives that (a refusal). On the loop."""
        failure = self.ctx.failure
        cause = failure.cause(exc, job.name, job.seq)
        assert self._sockets is not None
        if not failure.plane_survives(cause, mid_round=False):
            self._sockets.abort(failure.abort_message(cause))

    async def _deadline(self, job: Job) -> FerroGrpcError:
        return self._direct_deadline(job)

    async def _settle_direct(self, exc: FerroGrpcError, job: Job) -> FerroGrpcError:
        self._abort_plane(exc, job)
        return await self.ctx.failure.settle(exc, job.name, job.seq)

    async def point_to_point(
        self, job: Job, run: Callable[[], Coroutine[Any, Any, None]], peer: int | None = None
    ) -> None:
        """Run a send or receive (``job`` names it; it takes no sequence
        number) with ``peer`` (None: any) under the same deadline and
        failure policy as a collective."""
        self.check_open()
        observer = self.observer
        entry = observer.called(-1, job.name, job.buffer.nbytes, _dtype_name(job.buffer.dtype))
        observer.started(entry, "p2p", () if peer is None else (peer,))
        self.jobs.track(job)
        error: BaseException | None = None
        try:
            await self._supervise(job, run)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.jobs.untrack(job)
            observer.ended(entry, error)

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
            job.begin(asyncio.current_task())
            work = run()
        else:
            task = asyncio.ensure_future(run())
            job.begin(task)
            work = task
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
        except FerroGrpcError as exc:
            # First: a CollectiveTimeoutError (a stuck peer) is a TimeoutError
            # too, and is settled like any failure: it breaks the rank.
            raise await failure.settle(exc, job.name, job.seq) from exc.__cause__
        except TimeoutError:
            if not deadline.expired():
                raise
            raise failure.deadline_passed(job.name, job.seq, deadline_s) from None
        except BaseExceptionGroup as group:
            err = _first_ferro(group) or ctx.identity.error(
                PeerError, f"internal failure: {group!r}", op=job.name, seq=job.seq
            )
            raise await failure.settle(err, job.name, job.seq) from group

    # ------------------------------------------------------------- refusals

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


def _loopback(address: str) -> bool:
    """Whether ``host:port`` names this machine's loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32, for the observer's entries."""
    return str(dtype).removeprefix("torch.")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


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
