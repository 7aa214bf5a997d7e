"""The observer: one per peer, told of every collective and every wait.

[Note: what the observer sees]

- A collective's :class:`Entry` is made when it is *called* (on the caller's
  thread, when it takes its sequence number: ``Engine.number``), marked when
  it *starts* (its path chosen: ``Engine._runner``) and when it *ends* (done
  or failed: ``Engine._retire``). A send or receive has an entry too, with
  seq -1. The flight recorder keeps every entry (flight.py); the sinks
  (metrics, the trace) see each one once, when it ends.
- A *span* is a wait a wrapper names (``DDP_BUCKET_WAIT``,
  ``FSDP_GATHER_WAIT``, ...): ``with observer.span(cat, name, **args)``,
  or one timed elsewhere: :meth:`Observer.record` (``FSDP_RESHARD``).
  With no span sink it is a shared null context, so a run that traces
  nothing pays one attribute test per span.
- Times are ``time.time()`` seconds: wall clocks, which ``ferrogrpc trace
  merge`` aligns across hosts with the offsets measured at start-up.

What the observer costs a healthy run is the flight recorder's: one small
object and three clock reads per collective (docs/benchmarks-history.md,
"Observability overhead").
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import FerroGrpcError, Identity
from . import logs
from .flight import DONE, FAILED, RUNNING, Entry, FlightRecorder
from .stats import Stats

# The waits the wrappers name (span categories).
DDP_BUCKET_WAIT = "ddp.bucket_wait"
DDP_BUCKET = "ddp.bucket"
FSDP_GATHER_WAIT = "fsdp.gather_wait"
FSDP_REDUCE_WAIT = "fsdp.reduce_wait"
# Not a wait: an elastic FSDP's re-shard at a new epoch, from its first
# message to the new layout in effect (wrappers/fsdp_elastic.py).
FSDP_RESHARD = "fsdp.reshard"


@dataclasses.dataclass(frozen=True)
class Span:
    """A wait a wrapper named: ``cat`` (one of the constants above), a
    ``name`` for the trace, wall-clock ``start`` and ``end``, and ``args``."""

    cat: str
    name: str
    start: float
    end: float
    args: dict[str, Any]
    thread: int


class Observer:
    """What one peer saw (see [Note: what the observer sees]). ``flight``
    is its flight recorder; ``collective_sinks`` and ``span_sinks`` are
    called (on whatever thread ended the collective or the span) with each
    ended entry and span; a sink must be quick and must not raise."""

    def __init__(self, identity: Identity, flight_dir: str | None = None) -> None:
        self.identity = identity
        self.flight = FlightRecorder(identity, flight_dir)
        # The rank's byte and collective counters (every path adds to them).
        self.stats = Stats()
        self.collective_sinks: list[Callable[[Entry], None]] = []
        self.span_sinks: list[Callable[[Span], None]] = []
        # Called with the error when the rank breaks (after the flight dump).
        self.break_sinks: list[Callable[[FerroGrpcError], None]] = []
        # Called once when the peer closes (a trace writes its file).
        self.close_sinks: list[Callable[[], None]] = []

    # ------------------------------------------------------------ collectives

    def called(self, seq: int, op: str, nbytes: int, dtype: str) -> Entry:
        entry = Entry(seq, op, nbytes, dtype)
        self.flight.add(entry)
        return entry

    @staticmethod
    def started(entry: Entry, path: str, peers: tuple[int, ...]) -> None:
        entry.path = path
        entry.peers = peers
        entry.started = time.time()
        entry.state = RUNNING

    def ended(self, entry: Entry, error: BaseException | None) -> None:
        entry.ended = time.time()
        if entry.started == 0.0:
            entry.started = entry.ended  # refused, or failed before it ran
        if error is None:
            entry.state = DONE
        else:
            entry.state = FAILED
            entry.error_kind = type(error).__name__
            entry.error = str(error)
            if isinstance(error, FerroGrpcError):
                entry.culprit = error.peer
        for sink in self.collective_sinks:
            sink(entry)

    # ------------------------------------------------------------------ spans

    def span(self, cat: str, name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        """A wait named ``cat``/``name``, timed for the span sinks (a null
        context when there are none)."""
        if not self.span_sinks:
            return _NULL
        return self._timed(cat, name, args)

    @contextlib.contextmanager
    def _timed(self, cat: str, name: str, args: dict[str, Any]) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.record(cat, name, start, time.time(), **args)

    def record(self, cat: str, name: str, start: float, end: float, **args: Any) -> None:
        """A span timed elsewhere (wall-clock ``start`` and ``end``): a wait
        with no ``with`` block around it, such as a DDP bucket's all-reduce
        from launch to done."""
        if not self.span_sinks:
            return
        span = Span(cat, name, start, end, args, threading.get_ident())
        for sink in self.span_sinks:
            sink(span)

    def close(self) -> None:
        """The peer closed: tell the close sinks (once). Never raises."""
        sinks, self.close_sinks = self.close_sinks, []
        for sink in sinks:
            with contextlib.suppress(Exception):
                sink()

    # ---------------------------------------------------------------- failure

    def broke(self, err: FerroGrpcError) -> None:
        """The rank broke with ``err``: dump the flight recorder (when a
        directory is set), then tell the break sinks. Never raises."""
        path = self.flight.dump(err)
        if path is not None:
            logs.for_rank(self.identity).warning(
                "rank %d: flight record written to %s (ferrogrpc diagnose %s)",
                self.identity.rank,
                path,
                path.parent,
                extra=logs.error_fields(err),
            )
        for sink in self.break_sinks:
            # A sink must not hide the failure being reported.
            with contextlib.suppress(Exception):
                sink(err)


_NULL: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
