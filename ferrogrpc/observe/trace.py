"""The trace: each rank's collectives and waits as a Chrome/Perfetto trace
(``FERROGRPC_TRACE=DIR``), and the merge of every rank's file onto rank 0's
clock (``ferrogrpc trace merge DIR -o run.json``).

[Note: the trace file]
A traced rank's :class:`TraceWriter` is a sink of its observer (see [Note:
what the observer sees] in observer.py). It turns each ended collective and
each span into Trace Event Format "X" (complete) events: ``ts`` and ``dur``
in microseconds of the rank's wall clock, ``pid`` the rank, ``tid`` a lane.

- A collective is a slice named by its op (args: seq, op, bytes, dtype,
  path, peers, state; error and culprit when it failed) from when it was
  called to when it ended, holding two: "waiting for its turn" (called to
  started) and the run, named by its path ("ring", "shared memory", ...).
- A span is a slice in its category's lanes: "DDP buckets" (a bucket's
  all-reduce, launch to done), "DDP waits" (``sync_gradients`` waiting for a
  bucket), "FSDP waits" (a unit's gather, the reduce-scatters).
- Collectives overlap (DDP buckets in flight together); slices in one
  Chrome thread must not, so each kind has lanes: an event goes to the
  first lane where it overlaps none of the last ``LANE_MEMORY`` events.
  "M" events name the process ("rank N") and the lanes.

Memory stays bounded: events wait in a list of at most ``FLUSH_EVENTS``,
then go to a spool file beside the trace (one JSON event a line), in
segments of ``SEGMENT_EVENTS``; when a third segment starts the oldest is
deleted and its events counted as ``dropped`` in the header. So a file
holds the run's last 250,000 to 500,000 events (a DDP step with ten
buckets makes about 50), and memory never holds more than a few thousand.

The file itself, ``trace-rank00003-pid1234-0.json`` (rank, process, and
which of the process's groups: an elastic process joins one group per
epoch), is written (aside, then renamed: see [Note: files in a shared
directory] in files.py) when the peer closes, when the rank breaks, and at
interpreter exit, so a run that failed or was interrupted still leaves it;
one killed outright (SIGKILL) leaves only the spool. Its
``otherData`` is the header: format, rank, world size, group (the digest
the flight recorder uses), host, pid, the clock offset to rank 0 with its
round trip (see [Note: clock offset] in clock.py), the event counts.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError, FerroGrpcError, Identity
from ..transport.streams import Transport
from . import files, schema
from .clock import SAME_CLOCK, ClockOffset, measure
from .flight import Entry, group_digest
from .observer import (
    DDP_BUCKET,
    DDP_BUCKET_WAIT,
    FSDP_GATHER_WAIT,
    FSDP_REDUCE_WAIT,
    Observer,
    Span,
)

FORMAT = "ferrogrpc-trace/1"
MERGED_FORMAT = "ferrogrpc-trace-merged/1"
# Events kept in memory before they go to the spool.
FLUSH_EVENTS = 4096
# Events per spool segment; two are kept (see [Note: the trace file]).
SEGMENT_EVENTS = 250_000
# Recent slices each lane remembers, to place the next one where it fits.
LANE_MEMORY = 64
FILE_PATTERN = "trace-rank*.json"

# The lanes of each kind of event: (name, first tid).
COLLECTIVES = ("collectives", 1)
_SPAN_LANES: dict[str, tuple[str, int]] = {
    DDP_BUCKET: ("DDP buckets", 100),
    DDP_BUCKET_WAIT: ("DDP waits", 200),
    FSDP_GATHER_WAIT: ("FSDP waits", 300),
    FSDP_REDUCE_WAIT: ("FSDP waits", 300),
}
_OTHER_LANES = 1000

logger = logging.getLogger("ferrogrpc")
_files = itertools.count()
# Every writer not yet closed, written at interpreter exit.
_live: weakref.WeakSet[TraceWriter] = weakref.WeakSet()
# Each traced observer's writer: the peer hands it the clock offset.
_writers: weakref.WeakKeyDictionary[Observer, TraceWriter] = weakref.WeakKeyDictionary()


def attach(observer: Observer, directory: str) -> TraceWriter:
    """Trace ``observer``'s rank into ``directory``: a writer that sees
    every collective and span, writes when the rank breaks, and closes with
    the peer."""
    writer = TraceWriter(observer.identity, directory)
    observer.collective_sinks.append(writer.collective)
    observer.span_sinks.append(writer.span)
    observer.break_sinks.append(writer.broke)
    observer.close_sinks.append(writer.close)
    _writers[observer] = writer
    return writer


def writer_of(observer: Observer) -> TraceWriter | None:
    """``observer``'s trace writer (None: not traced)."""
    return _writers.get(observer)


async def measure_clock(
    observer: Observer, transport: Transport, timeout: float
) -> ClockOffset | None:
    """If ``observer``'s rank is traced, measure its clock offset to rank 0
    over ``transport`` (clock.py) and put it in the trace's header. A
    failed measurement is logged, never raised: the trace is still written,
    unaligned. On the peer's loop, once the group has formed."""
    writer = _writers.get(observer)
    if writer is None:
        return None
    me = observer.identity
    try:
        clock = await measure(transport, me.rank, timeout)
    except FerroGrpcError as exc:
        logger.warning("rank %d: could not measure its clock offset to rank 0: %s", me.rank, exc)
        return None
    if clock is None:
        logger.warning("rank %d: rank 0 does not tell its clock (an older ferrogrpc)", me.rank)
    writer.clock = clock
    return clock


class _Lanes:
    """The lanes (trace threads) of one kind of event; see [Note: the trace
    file]."""

    def __init__(self, name: str, first_tid: int) -> None:
        self.name = name
        self.first_tid = first_tid
        self._recent: list[collections.deque[tuple[float, float]]] = []

    def place(self, start: float, end: float) -> tuple[int, bool]:
        """The tid for a slice from ``start`` to ``end``, and whether its
        lane is new."""
        for i, recent in enumerate(self._recent):
            if all(end <= s or start >= e for s, e in recent):
                recent.append((start, end))
                return self.first_tid + i, False
        self._recent.append(collections.deque([(start, end)], maxlen=LANE_MEMORY))
        return self.first_tid + len(self._recent) - 1, True

    def label(self, tid: int) -> str:
        n = tid - self.first_tid
        return self.name if n == 0 else f"{self.name} ({n + 1})"


def _us(t: float) -> float:
    # Wall-clock microseconds as a double resolve a quarter of one.
    return round(t * 1e6, 2)


class TraceWriter:
    """One rank's trace file (see [Note: the trace file]). Its sinks may be
    called from any thread; they are quick (a dict, a lock) but for one
    call in ``FLUSH_EVENTS``, which appends to the spool."""

    def __init__(self, identity: Identity, directory: str) -> None:
        self.identity = identity
        self.folder = Path(directory)
        # Every file of the trace is made and opened relative to this
        # descriptor, checked once (files.py).
        try:
            self._dir_fd = files.open_directory(self.folder, "the trace directory")
        except files.UnsafeDirectoryError as exc:
            raise ConfigError(str(exc)) from None
        name = f"trace-rank{identity.rank:05d}-pid{os.getpid()}-{next(_files)}.json"
        self.path = self.folder / name
        # A name no other user can guess, to plant something there first.
        self._spool_stem = f".{name}.{secrets.token_hex(8)}.spool"
        # The clock offset to rank 0: rank 0's is nil; the others' are set
        # once measured (measure_clock).
        self.clock: ClockOffset | None = SAME_CLOCK if identity.rank == 0 else None
        self._lock = threading.Lock()
        # One file write at a time (a break's, close's, exit's).
        self._file_lock = threading.Lock()
        self.writing: threading.Thread | None = None
        self._buffer: list[str] = []
        self._meta: list[str] = []
        # The spool's segments: (name in the folder, events written to it).
        self._segments: collections.deque[tuple[str, int]] = collections.deque()
        self._segment_ids = itertools.count()
        self._lanes: dict[str, _Lanes] = {}
        self.events = 0
        self.dropped = 0
        self._closed = False
        rank = identity.rank
        self._meta_event("process_name", None, {"name": f"rank {rank}"})
        self._meta_event("process_sort_index", None, {"sort_index": rank})
        _live.add(self)

    # ------------------------------------------------------------- the sinks

    def collective(self, entry: Entry) -> None:
        """An ended collective (a send or receive has seq -1)."""
        args: dict[str, Any] = {
            "seq": entry.seq,
            "op": entry.op,
            "bytes": entry.nbytes,
            "dtype": entry.dtype,
            "path": entry.path,
            "peers": list(entry.peers),
            "state": entry.state,
        }
        if entry.error_kind is not None:
            args["error"] = entry.error_kind
            args["culprit"] = entry.culprit
        called, started, ended = entry.called, entry.started, entry.ended
        with self._lock:
            if self._closed:
                return
            tid = self._place(COLLECTIVES, called, ended)
            self._slice(entry.op, "collective", called, ended, tid, args)
            mark = {"seq": entry.seq}
            self._slice("waiting for its turn", "collective.wait", called, started, tid, mark)
            self._slice(entry.path or "run", "collective.run", started, ended, tid, mark)

    def span(self, span: Span) -> None:
        """An ended span (a wait a wrapper named)."""
        lanes = _SPAN_LANES.get(span.cat) or (span.cat, 0)
        with self._lock:
            if self._closed:
                return
            tid = self._place(lanes, span.start, span.end)
            self._slice(span.name, span.cat, span.start, span.end, tid, dict(span.args))

    def broke(self, err: FerroGrpcError) -> None:
        """The rank broke: write the file now (the process may not get to
        close the peer), in a thread of its own (``writing``): the loop that
        called this goes on telling the other ranks."""
        self.writing = threading.Thread(target=self.write, name="ferrogrpc-trace", daemon=True)
        self.writing.start()

    def close(self) -> None:
        """The peer closed: write the file, delete the spool, take no more
        events."""
        self.finish(complete=True)

    def finish(self, complete: bool) -> None:
        """Write the file one last time (``complete``: the peer closed, not
        the interpreter exiting around it), delete the spool, and take no
        more events."""
        self._write(final=complete)
        _live.discard(self)
        with self._file_lock:  # a write after this one finds the writer closed
            fd, self._dir_fd = self._dir_fd, -1
            if fd >= 0:
                os.close(fd)

    # ------------------------------------------------------------ the events

    def _place(self, lanes: tuple[str, int], start: float, end: float) -> int:
        name, first = lanes
        kind = self._lanes.get(name)
        if kind is None:
            if first == 0:  # a category with no lanes of its own
                first = _OTHER_LANES * (
                    1 + sum(k.first_tid >= _OTHER_LANES for k in self._lanes.values())
                )
            kind = self._lanes[name] = _Lanes(name, first)
        tid, new = kind.place(start, end)
        if new:
            self._meta_event("thread_name", tid, {"name": kind.label(tid)})
            self._meta_event("thread_sort_index", tid, {"sort_index": tid})
        return tid

    def _meta_event(self, name: str, tid: int | None, args: dict[str, Any]) -> None:
        event: dict[str, Any] = {"ph": "M", "name": name, "pid": self.identity.rank, "args": args}
        if tid is not None:
            event["tid"] = tid
        self._meta.append(json.dumps(event))

    def _slice(
        self, name: str, cat: str, start: float, end: float, tid: int, args: dict[str, Any]
    ) -> None:
        event = {
            "ph": "X",
            "name": name,
            "cat": cat,
            "pid": self.identity.rank,
            "tid": tid,
            "ts": _us(start),
            "dur": _us(max(end - start, 0.0)),
            "args": args,
        }
        self._buffer.append(json.dumps(event))
        self.events += 1
        if len(self._buffer) >= FLUSH_EVENTS:
            self._spill()

    def _spill(self) -> None:
        """Append the buffered events to the spool's newest segment (a new
        one when it is full; the oldest deleted beyond two)."""
        if not self._buffer:
            return
        if not self._segments or self._segments[-1][1] >= SEGMENT_EVENTS:
            self._segments.append((f"{self._spool_stem}{next(self._segment_ids)}", 0))
            if len(self._segments) > 2:
                old, count = self._segments.popleft()
                self.dropped += count
                self.events -= count
                with contextlib.suppress(OSError):
                    files.unlink(self._dir_fd, old)
        name, count = self._segments[-1]
        # A segment's file exists once something was written to it.
        new = count == 0
        try:
            with files.open_append(self._dir_fd, name, new=new) as f:
                f.write("\n".join(self._buffer))
                f.write("\n")
        except OSError as exc:
            logger.warning("rank %d: could not spool its trace: %s", self.identity.rank, exc)
            self.dropped += len(self._buffer)
            self.events -= len(self._buffer)
            if new:
                with contextlib.suppress(OSError):
                    files.unlink(self._dir_fd, name)
        else:
            self._segments[-1] = (name, count + len(self._buffer))
        self._buffer.clear()

    # ------------------------------------------------------------ the file

    def header(self, complete: bool = False) -> dict[str, Any]:
        """The file's ``otherData``: who this rank is, its clock, the counts."""
        me = self.identity
        return {
            "format": FORMAT,
            "rank": me.rank,
            "world_size": me.world_size,
            "group": group_digest(list(me.addresses)),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "clock": None if self.clock is None else self.clock.as_dict(),
            "events": self.events,
            "dropped": self.dropped,
            "kept_at_most": 2 * SEGMENT_EVENTS,
            "written_at": time.time(),
            "complete": complete,
        }

    def write(self) -> Path | None:
        """Write the file with every event so far (the writer goes on); its
        path, or None if it could not be written (logged) or is closed."""
        return self._write(final=None)

    def _write(self, final: bool | None) -> Path | None:
        """Write the file; with ``final`` (whether complete), the last time.
        The events are taken under the lock (the spool's segments opened,
        and how many lines each holds), and the file is assembled outside
        it, so the sinks never wait for the disk."""
        with self._file_lock:
            with self._lock:
                if self._closed:
                    return None
                self._spill()
                header = self.header(complete=bool(final))
                meta = list(self._meta)
                segments = list(self._segments)
                if final is not None:
                    self._closed = True
                    self._segments.clear()
                try:
                    # Open now: a segment rotated away meanwhile stays readable.
                    opened = [(files.open_read(self._dir_fd, n), count) for n, count in segments]
                except OSError as exc:
                    logger.warning("rank %d: its trace spool is gone: %s", self.identity.rank, exc)
                    opened = []
            try:
                return self._assemble(header, meta, opened)
            finally:
                for f, _ in opened:
                    f.close()
                if final is not None:
                    for name, _ in segments:
                        with contextlib.suppress(OSError):
                            files.unlink(self._dir_fd, name)

    def _assemble(
        self, header: dict[str, Any], meta: list[str], segments: Sequence[tuple[TextIO, int]]
    ) -> Path | None:
        spooled = (
            line.rstrip("\n") for f, count in segments for line in itertools.islice(f, count)
        )

        def parts() -> Iterator[str]:
            yield '{"otherData": '
            yield json.dumps(header)
            yield ',\n"displayTimeUnit": "ms",\n"traceEvents": [\n'
            yield ",\n".join(meta)
            for line in spooled:
                yield ",\n"
                yield line
            yield "\n]}\n"

        try:
            files.write_new(self._dir_fd, self.path.name, parts())
        except OSError as exc:
            logger.warning("rank %d: could not write its trace: %s", self.identity.rank, exc)
            return None
        return self.path


@atexit.register
def _write_all() -> None:
    """At interpreter exit, write every trace not yet closed: its peer was
    never closed (an exception, an interrupt, or no close() at all)."""
    for writer in list(_live):
        writer.finish(complete=False)


# ------------------------------------------------------------------- merge


# A trace file's largest: its 500,000 events at most take about 150 MB.
MAX_TRACE_BYTES = 1 << 30
# The most events a file may hold: what the spool keeps, twice, and room.
MAX_TRACE_EVENTS = 4 * 2 * SEGMENT_EVENTS


def load(path: str | Path) -> dict[str, Any]:
    """One rank's trace file, read as hostile (see [Note: records read as
    hostile] in schema.py): its header's fields (the ones a merge and the
    command use, and only those, are kept), and each event an object whose
    ``ts`` and ``dur`` are numbers, nested no deeper than the writer's.
    ValueError, one line naming the file and the field, for a file that is
    not a trace."""
    data = schema.read_json(Path(path), MAX_TRACE_BYTES, "trace file")
    try:
        top = schema.Fields(data)
        header = top.object("otherData")
        if header.data.get("format") != FORMAT:
            raise schema.SchemaError("otherData.format", f"{FORMAT} expected")
        checked = _header(header)
        events = top.array("traceEvents", MAX_TRACE_EVENTS)
        for i, event in enumerate(events):
            fields = schema.Fields(event, f"traceEvents[{i}]")
            for key in ("ts", "dur"):
                if key in event:
                    fields.number(key)
            for key, value in event.items():
                if isinstance(value, (dict, list)):
                    schema.check_depth(value, fields.name(key))
    except schema.SchemaError as exc:
        raise ValueError(f"{path}: not a ferrogrpc trace file: {exc}") from None
    return {"otherData": checked, "displayTimeUnit": "ms", "traceEvents": events}


def _header(h: schema.Fields) -> dict[str, Any]:
    """A trace file's header, each field :meth:`TraceWriter.header` writes
    checked."""
    world = h.integer("world_size", 1, schema.MAX_WORLD_SIZE)
    clock = h.maybe_object("clock")
    count = (0, 2**63 - 1)
    return {
        "format": FORMAT,
        "rank": h.integer("rank", 0, world - 1),
        "world_size": world,
        "group": h.maybe_string("group", 256),
        "host": h.maybe_string("host", 1024),
        "pid": h.maybe_integer("pid", 0, 2**32),
        "clock": None
        if clock is None
        else {
            "offset_s": clock.number("offset_s"),
            "round_trip_s": clock.number("round_trip_s"),
            "error_bound_s": clock.number("error_bound_s"),
            "samples": clock.integer("samples", *count),
            "reference_rank": clock.maybe_integer("reference_rank", 0, world - 1) or 0,
        },
        "events": h.integer("events", *count),
        "dropped": h.maybe_integer("dropped", *count) or 0,
        "kept_at_most": h.maybe_integer("kept_at_most", *count),
        "written_at": h.maybe_number("written_at"),
        "complete": h.boolean("complete") if h.has("complete") else False,
    }


def trace_files(directory: str | Path) -> list[Path]:
    """Every rank's trace file in ``directory``; ValueError when it is not
    a directory or holds none."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a directory")
    found = sorted(folder.glob(FILE_PATTERN))
    if len(found) > 4 * schema.MAX_WORLD_SIZE:
        raise ValueError(f"{folder}: {len(found)} trace files, more than a merge reads")
    if not found:
        raise ValueError(
            f"{folder}: no trace files ({FILE_PATTERN}); run with FERROGRPC_TRACE={folder}"
        )
    return found


def merge(directory: str | Path, out: str | Path) -> dict[str, Any]:
    """Merge every rank's trace in ``directory`` into one Chrome trace at
    ``out``: one process per rank, each rank's timestamps moved onto rank
    0's clock by the offset it measured (see [Note: clock offset] in
    clock.py). Returns the merged file's ``otherData``: the ranks' headers,
    and which ranks had no offset (left on their own clock). Raises
    ValueError for a directory without trace files or a file that is not
    one.

    An elastic run leaves one file per process per epoch (``group`` in the
    header tells them apart); each goes into the process of the rank it
    had then, aligned to that epoch's rank 0 (on one host, the same
    clock)."""
    events: list[dict[str, Any]] = []
    headers: list[dict[str, Any]] = []
    unaligned: list[int] = []
    for path in trace_files(directory):
        data = load(path)
        header = data["otherData"]
        rank = int(header["rank"])
        clock = header.get("clock")
        shift = 0.0
        if clock is None:
            unaligned.append(rank)
        else:
            shift = ClockOffset.from_dict(clock).offset * 1e6
        for event in data["traceEvents"]:
            event["pid"] = rank
            if "ts" in event:
                event["ts"] = round(event["ts"] + shift, 3)
            events.append(event)
        headers.append({**header, "file": path.name})
    groups = sorted({str(h.get("group")) for h in headers})
    merged_header = {
        "format": MERGED_FORMAT,
        "clock": "rank 0's wall clock (time.time() microseconds)",
        "ranks": sorted({int(h["rank"]) for h in headers}),
        "groups": groups,
        "unaligned_ranks": sorted(set(unaligned)),
        "files": headers,
    }
    target = Path(out)
    merged = {"otherData": merged_header, "displayTimeUnit": "ms", "traceEvents": events}
    # Aside, then renamed, never through a link planted at either name (see
    # [Note: files in a shared directory] in files.py); the directory is
    # the user's choice, so it is not checked.
    folder = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        files.write_new(folder, target.name, json.JSONEncoder().iterencode(merged))
    finally:
        os.close(folder)
    return merged_header
