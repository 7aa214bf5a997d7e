"""One record per collective in flight, and the table that numbers them.

A :class:`Job` is created when a collective is *called* (on the caller's
thread: that is when it takes its sequence number) and lives in the
:class:`JobTable` until it has finished, failed, or been abandoned. The
stream intake asks the table whether a sequence number is still expected;
the failure policy cancels the running ones through it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import FerroGrpcError
from ..observe.flight import Entry
from ..ops import ReduceOp
from ..v1 import collective_pb2 as pb
from .staging import Stage

E = TypeVar("E", bound=FerroGrpcError)

# Refused sequence numbers remembered (see JobTable.refuse): far more than can
# be in flight at once.
REFUSALS_KEPT = 1024


class JobState(enum.Enum):
    """[Note: job states]

    ::

        WAITING ──begin()──> RUNNING ──finish──> DONE
           │                    │                  ^
           │                    └──cancel()/stop()─┴─> STOPPING ──finish──┘
           └──────────────finish (refused, closed, broken)───────────────> DONE

    - ``WAITING``: numbered when it was called (on the caller's thread); it
      has not started, and may be waiting for its turn.
    - ``RUNNING``: its algorithm runs: in a loop task (``task``), or in a
      thread (a direct job, on the direct sockets).
    - ``STOPPING``: stopped from outside while running (another rank's
      report, a refusal, ``close()``, its deadline): it raises ``error``.
      Its task is cancelled; a thread running it sees the state and stops.
    - ``DONE``: finished, failed or refused; it has left the job table.
    """

    WAITING = "waiting"
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


@dataclasses.dataclass(eq=False)
class Job:
    """One collective as this rank sees it (see [Note: job states])."""

    seq: int
    name: str
    descriptor: pb.Descriptor
    # The flat tensor the ring reads from and (in place) writes to.
    buffer: torch.Tensor
    op: ReduceOp
    # For out-of-place reduce-scatter: where the finished segment goes, and the
    # element offset of that segment in ``buffer``.
    out: torch.Tensor | None = None
    out_offset: int = 0
    # Device staging (see staging.py), or None for host tensors.
    stage: Stage | None = None
    # The dtype its chunks travel in over gRPC, if narrower than buffer's.
    wire: torch.dtype | None = None
    # For all_to_all: the elements this rank sends to each rank, and those it
    # receives from each.
    splits: tuple[list[int], list[int]] | None = None
    # Whether it must take its turn (see JobTable.turn).
    ordered: bool = False
    # Whether it runs on the direct sockets (direct.py), in its turn among
    # those (JobTable.direct_turn).
    direct: bool = False
    state: JobState = JobState.WAITING
    # The loop task running it while it runs there (cancel() cancels it).
    task: asyncio.Task[Any] | None = None
    # Why it was stopped from outside (set with STOPPING).
    error: FerroGrpcError | None = None
    # What the observer records of it (observe/flight.py), once numbered.
    entry: Entry | None = None

    @property
    def kind(self) -> int:
        return self.descriptor.kind

    def begin(self, task: asyncio.Task[Any] | None) -> None:
        """WAITING -> RUNNING, in ``task`` (None: in a thread)."""
        self.task = task
        if self.state is JobState.WAITING:
            self.state = JobState.RUNNING

    def cancel(self, err: FerroGrpcError) -> None:
        """RUNNING -> STOPPING: cancel its task, to raise ``err``; nothing if
        it is not running in a task."""
        if self.state is JobState.RUNNING and self.task is not None and not self.task.done():
            self.error = err
            self.state = JobState.STOPPING
            self.task.cancel()

    def stop(self, err: FerroGrpcError) -> None:
        """RUNNING -> STOPPING without a task: the thread running it stops
        at its next check, to raise ``err`` (the first reason given)."""
        if self.state is not JobState.STOPPING:
            self.error = err
            self.state = JobState.STOPPING

    @property
    def stopping(self) -> bool:
        return self.state is JobState.STOPPING


class JobTable:
    """Sequence numbers and the jobs holding them. Thread-safe for
    :meth:`add` (callers' threads); everything else runs on the loop."""

    def __init__(self, world_size: int) -> None:
        self._world = world_size
        self._seq = 0
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        # Ordered jobs (see turn()) and direct jobs (direct_turn()) not
        # finished yet, each kind in call order.
        self._ordered = _Turns(self._lock)
        self._direct = _Turns(self._lock)
        # Called when a job is stopped from outside (a refusal, a break), to
        # wake a thread running a direct job (see direct.py).
        self.wake: Callable[[], None] | None = None
        # Point-to-point operations running: no sequence number of the
        # group's, but stopped like the collectives when the rank breaks.
        self._untracked: set[Job] = set()
        # Collectives refused by some rank's argument checks, by seq: this
        # rank's own (refuse()) and other ranks' (note_refusal()).
        self._refused: collections.OrderedDict[int, FerroGrpcError] = collections.OrderedDict()

    @property
    def last_seq(self) -> int:
        return self._seq

    def add(
        self,
        name: str,
        descriptor: pb.Descriptor,
        buffer: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        out: torch.Tensor | None = None,
        out_offset: int = 0,
        ordered: bool = False,
        wire: torch.dtype | None = None,
        direct: bool = False,
    ) -> Job:
        """A new job with the next sequence number. A group of one runs no
        ring, so its jobs are not tracked. An ``ordered`` job runs only once
        every ordered job called before it has finished (see turn()); a
        ``direct`` one, every direct job called before it (direct_turn())."""
        with self._lock:
            seq = self._seq + 1
            job = Job(
                seq,
                name,
                descriptor,
                buffer,
                op,
                out,
                out_offset,
                ordered=ordered,
                wire=wire,
                direct=direct,
            )
            # Registered before the new seq is visible: the intake reads _seq
            # without the lock and must never see a seq that is not tracked.
            if self._world > 1:
                self._jobs[seq] = job
                if ordered:
                    self._ordered.queue.append(seq)
                if direct:
                    self._direct.queue.append(seq)
            self._seq = seq
        return job

    def direct_head(self, seq: int) -> bool:
        """Whether direct job ``seq`` may run now (thread-safe)."""
        return self._direct.head_is(seq)

    async def direct_turn(self, seq: int) -> None:
        """Return once ``seq`` is the oldest unfinished direct job: direct
        jobs share the direct sockets, one at a time, in call order (the same
        order on every rank)."""
        await self._direct.wait(seq)

    async def turn(self, seq: int) -> None:
        """Return once ``seq`` is the oldest unfinished ordered job: jobs that
        share one resource (a host's shared segments) take turns in call
        order, which is the same order on every rank."""
        await self._ordered.wait(seq)

    def refuse(self, make_error: Callable[[int], E], count: int = 1) -> list[E]:
        """Take the next ``count`` sequence numbers for a call that this
        rank's own argument checks refused, and remember each as refused
        with ``make_error(seq)``. Atomic with the numbering: the intake never
        sees such a seq taken but not yet known as refused."""
        with self._lock:
            errors = []
            for _ in range(count):
                seq = self._seq + 1
                err = make_error(seq)
                self._remember(seq, err)
                self._seq = seq
                errors.append(err)
        return errors

    def note_refusal(self, seq: int, err: FerroGrpcError) -> bool:
        """Another rank refused collective ``seq`` (``err`` says so): remember
        it, and stop this rank's job for it if it is running. False if it was
        already known."""
        with self._lock:
            if seq in self._refused:
                return False
            self._remember(seq, err)
        job = self._jobs.get(seq)
        if job is not None:
            job.cancel(err)
        if self.wake is not None:
            self.wake()
        return True

    def _remember(self, seq: int, err: FerroGrpcError) -> None:
        self._refused[seq] = err
        while len(self._refused) > REFUSALS_KEPT:
            self._refused.popitem(last=False)

    def refused(self, seq: int) -> FerroGrpcError | None:
        """Why collective ``seq`` was refused, if some rank refused it."""
        return self._refused.get(seq)

    def expects(self, seq: int) -> bool:
        """Whether a stream for ``seq`` may still be consumed here."""
        return seq > self._seq or seq in self._jobs

    def running(self, seq: int) -> bool:
        """Whether collective ``seq`` has started here and not finished."""
        job = self._jobs.get(seq)
        return job is not None and job.task is not None and not job.task.done()

    def name_of(self, seq: int) -> str | None:
        job = self._jobs.get(seq)
        return job.name if job is not None else None

    def finish(self, job: Job) -> None:
        """``job`` is done. On the loop, or for a direct job in the thread
        that ran it."""
        self._jobs.pop(job.seq, None)
        job.state = JobState.DONE
        if job.direct:
            self._direct.done(job.seq)
        if job.ordered:
            self._ordered.done(job.seq)

    def cancel_all(self, err: FerroGrpcError | Callable[[Job], FerroGrpcError]) -> None:
        """Stop every running job, to raise ``err`` (or ``err(job)``)."""
        for job in [*self._jobs.values(), *self._untracked]:
            job.cancel(err(job) if callable(err) else err)
        if self.wake is not None:
            self.wake()

    def track(self, job: Job) -> None:
        """Count a point-to-point operation among the running ones."""
        self._untracked.add(job)

    def untrack(self, job: Job) -> None:
        self._untracked.discard(job)

    def current(self) -> tuple[str, int]:
        """The oldest collective in flight, as (name, seq), or ("", last seq)."""
        jobs = self._jobs
        if jobs:
            job = jobs[min(jobs)]
            return job.name, job.seq
        return "", self._seq


class _Turns:
    """Jobs that take turns: their sequence numbers in call order, and who
    waits for which. Thread-safe (under the table's lock): a direct job
    finishes in the thread that ran it, and its waiters are on the loop."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.queue: collections.deque[int] = collections.deque()  # append under the lock
        self._waiters: dict[int, asyncio.Future[None]] = {}

    def head_is(self, seq: int) -> bool:
        with self._lock:
            return bool(self.queue) and self.queue[0] == seq

    async def wait(self, seq: int) -> None:
        """Return once ``seq`` heads the queue."""
        with self._lock:  # registered under the lock: done() may run in another thread
            if not self.queue or self.queue[0] == seq:
                return
            fut = self._waiters[seq] = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            with self._lock:
                self._waiters.pop(seq, None)

    def done(self, seq: int) -> None:
        """``seq`` finished: wake the new head's waiter, if any."""
        with self._lock:
            if seq in self.queue:
                self.queue.remove(seq)
            waiter = self._waiters.get(self.queue[0]) if self.queue else None
        if waiter is None:
            return
        loop = waiter.get_loop()
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            _set_if_pending(waiter)
        else:
            loop.call_soon_threadsafe(_set_if_pending, waiter)


def _set_if_pending(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
