"""The flight recorder: every rank's last collectives, dumped when it breaks.

[Note: flight recorder]
Always on. Each collective's :class:`Entry` goes into a ring of the last
``FLIGHT_ENTRIES`` (a deque: appending is one step under the GIL, from any
thread). An entry holds numbers and short strings, never a tensor, so the
ring pins no memory.

When the rank breaks (any failure the failure policy declares: a dead or
stalled peer, a deadline, corrupt data) and ``FERROGRPC_FLIGHT_DIR`` is set,
the ring is written there as one JSON file (:meth:`FlightRecorder.dump`,
written aside and renamed, so a reader never sees half a file, and never
through another user's link: see [Note: files in a shared directory] in
files.py): who this
rank is (rank, world size, every rank's address, host, pid), the error it
broke with, and the entries, oldest first. The collectives still running at
that moment show ``"running"``: they are what this rank was waiting in.
``ferrogrpc diagnose DIR`` (diagnose.py) reads every rank's dump and names
the culprit.

A process whose rank breaks more than once (an elastic member, re-formed)
writes one file per break: the ``group`` field (a digest of the ranks'
addresses, the same on every rank of one group) says which files belong
together.

A rank stopped by SIGTERM writes its ring too, with no cause, unless it
has already: a launcher (``ferrogrpc launch``, torchrun) stops the other
ranks as soon as one fails, and the stalled rank that the others waited
for, stopped before it heard of their failure, is the record diagnose
needs most. This holds where the process had no SIGTERM handler of its own
when ``init_backend`` was first called, on the main thread; the signal
then ends the process as before.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from ..errors import FerroGrpcError, Identity
from . import files, schema

# How many collectives each rank remembers: at a DDP step's handful of
# collectives, the last hundred steps or more.
FLIGHT_ENTRIES = 1024
FORMAT = "ferrogrpc-flight/1"

WAITING = "waiting"
RUNNING = "running"
DONE = "done"
FAILED = "failed"

logger = logging.getLogger("ferrogrpc")
_dumps = itertools.count()


class Entry:
    """One collective as this rank saw it (see [Note: what the observer
    sees] in observer.py). ``path`` is how it ran (``"ring"``, ``"one
    exchange"``, ``"direct"``, ``"shared memory"``, ``"two-level"``,
    ``"p2p"``, ``"alone"``); ``peers`` the ranks it exchanged with; times are
    ``time.time()`` seconds (0.0: not yet)."""

    __slots__ = (
        "called",
        "culprit",
        "dtype",
        "ended",
        "error",
        "error_kind",
        "nbytes",
        "op",
        "path",
        "peers",
        "seq",
        "started",
        "state",
    )

    def __init__(self, seq: int, op: str, nbytes: int, dtype: str) -> None:
        self.seq = seq
        self.op = op
        self.nbytes = nbytes
        self.dtype = dtype
        self.path = ""
        self.peers: tuple[int, ...] = ()
        self.called = time.time()
        self.started = 0.0
        self.ended = 0.0
        self.state = WAITING
        self.error: str | None = None
        self.error_kind: str | None = None
        self.culprit: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in _FIELDS}
        d["peers"] = list(self.peers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Entry:
        entry = cls(int(d["seq"]), str(d["op"]), int(d["nbytes"]), str(d["dtype"]))
        for name in _FIELDS:
            if name in d:
                value = d[name]
                setattr(entry, name, tuple(value) if name == "peers" else value)
        return entry


_FIELDS = (
    "seq",
    "op",
    "nbytes",
    "dtype",
    "path",
    "peers",
    "called",
    "started",
    "ended",
    "state",
    "error",
    "error_kind",
    "culprit",
)


def group_digest(addresses: list[str] | tuple[str, ...]) -> str:
    """The same on every rank of one group: a digest of every rank's address."""
    return hashlib.sha256("\n".join(addresses).encode()).hexdigest()[:16]


class FlightRecorder:
    """The ring of this rank's last collectives (see [Note: flight
    recorder]); ``directory`` is where :meth:`dump` writes (None: it writes
    nothing)."""

    def __init__(
        self, identity: Identity, directory: str | None = None, capacity: int = FLIGHT_ENTRIES
    ) -> None:
        self.identity = identity
        self.directory = directory
        self._ring: collections.deque[Entry] = collections.deque(maxlen=capacity)
        self.dumped: Path | None = None
        if directory:
            global _latest
            _latest = weakref.ref(self)

    def add(self, entry: Entry) -> None:
        self._ring.append(entry)

    def entries(self) -> list[Entry]:
        """The entries kept, oldest first (a copy)."""
        return list(self._ring)

    def snapshot(self, cause: FerroGrpcError | None = None) -> dict[str, Any]:
        """What :meth:`dump` writes, as a dict."""
        me = self.identity
        return {
            "format": FORMAT,
            "rank": me.rank,
            "world_size": me.world_size,
            "addresses": list(me.addresses),
            "group": group_digest(list(me.addresses)),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "dumped_at": time.time(),
            "cause": _describe(cause),
            "entries": [e.as_dict() for e in self.entries()],
        }

    def dump(self, cause: FerroGrpcError | None) -> Path | None:
        """Write the ring to the directory, if one is set; the file's path
        (None: no directory, or it could not be written, which is logged:
        a dump never adds a failure to the one being reported)."""
        if not self.directory:
            return None
        me = self.identity
        name = f"flight-rank{me.rank:05d}-pid{os.getpid()}-{next(_dumps)}.json"
        path = Path(self.directory) / name
        try:
            text = json.dumps(self.snapshot(cause))
            # files.UnsafeDirectoryError (a ValueError): another user's directory.
            with files.directory(self.directory, "the flight directory") as folder:
                files.write_new(folder, name, [text])
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("rank %d: could not write its flight record: %s", me.rank, exc)
            return None
        self.dumped = path
        return path


def _describe(err: FerroGrpcError | None) -> dict[str, Any] | None:
    if err is None:
        return None
    return {
        "kind": type(err).__name__,
        "message": str(err),
        "op": err.op,
        "seq": err.seq,
        "peer": err.peer,
        "evidence": err.evidence.value,
    }


# A record's largest file: the ring's 1024 entries take about 300 KiB.
MAX_RECORD_BYTES = 64 << 20
# The most entries a record may hold (the ring keeps FLIGHT_ENTRIES).
MAX_RECORD_ENTRIES = 64 * FLIGHT_ENTRIES
_STATES = (WAITING, RUNNING, DONE, FAILED)
_SEQ = (-1, 2**63 - 1)


def load(path: str | Path) -> dict[str, Any]:
    """One dump, read as hostile (see [Note: records read as hostile] in
    schema.py): its format, and every field :mod:`diagnose` uses checked
    for type and range. Returns the record with exactly those fields.
    ValueError, one line naming the file and the field, for a file that is
    not a record."""
    data = schema.read_json(Path(path), MAX_RECORD_BYTES, "flight record")
    try:
        top = schema.Fields(data)
        if data.get("format") != FORMAT:
            raise schema.SchemaError("format", f"{FORMAT} expected")
        return _checked(top)
    except schema.SchemaError as exc:
        raise ValueError(f"{path}: not a ferrogrpc flight record: {exc}") from None


def _checked(top: schema.Fields) -> dict[str, Any]:
    world = top.integer("world_size", 1, schema.MAX_WORLD_SIZE)
    last = world - 1
    addresses = top.array("addresses", world)
    cause = top.maybe_object("cause")
    return {
        "format": FORMAT,
        "rank": top.integer("rank", 0, last),
        "world_size": world,
        "addresses": [schema.string(a, f"addresses[{i}]", 1024) for i, a in enumerate(addresses)],
        "group": top.string("group", 256),
        "host": top.maybe_string("host", 1024),
        "pid": top.maybe_integer("pid", 0, 2**32),
        "dumped_at": top.number("dumped_at"),
        "cause": None
        if cause is None
        else {
            "kind": cause.string("kind", 256),
            "message": cause.maybe_string("message"),
            "op": cause.maybe_string("op", 256),
            "seq": cause.maybe_integer("seq", *_SEQ),
            "peer": cause.maybe_integer("peer", 0, last),
            "evidence": cause.maybe_string("evidence", 256),
        },
        "entries": [
            _entry(schema.Fields(e, f"entries[{i}]"), last)
            for i, e in enumerate(top.array("entries", MAX_RECORD_ENTRIES))
        ],
    }


def _entry(e: schema.Fields, last: int) -> dict[str, Any]:
    state = e.string("state", 32)
    if state not in _STATES:
        raise schema.SchemaError(e.name("state"), f"{state!r} is not one of {', '.join(_STATES)}")
    peers = e.array("peers", last + 1) if e.has("peers") else []
    return {
        "seq": e.integer("seq", *_SEQ),
        "op": e.string("op", 256),
        "nbytes": e.integer("nbytes", 0, 2**63 - 1),
        "dtype": e.string("dtype", 256),
        "path": e.maybe_string("path", 256) or "",
        "peers": [
            schema.integer(p, f"{e.name('peers')}[{i}]", 0, last) for i, p in enumerate(peers)
        ],
        "called": e.maybe_number("called") or 0.0,
        "started": e.maybe_number("started") or 0.0,
        "ended": e.maybe_number("ended") or 0.0,
        "state": state,
        "error": e.maybe_string("error"),
        "error_kind": e.maybe_string("error_kind", 256),
        "culprit": e.maybe_integer("culprit", 0, last),
    }


# The latest recorder with a directory (an elastic member's current epoch's),
# and the process that armed the SIGTERM handler (a forked child inherits
# the handler, not the rank).
_latest: weakref.ref[FlightRecorder] | None = None
_armed_pid = 0


def arm_sigterm() -> None:
    """On SIGTERM, write the latest recorder's ring first (see [Note: flight
    recorder]): init_backend calls this, on the caller's thread, when a
    flight directory is set. Only the main thread can, and only where the
    program has no SIGTERM handler of its own."""
    global _armed_pid
    if _armed_pid == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the program's own handler: left alone
    signal.signal(signal.SIGTERM, _on_sigterm)
    _armed_pid = os.getpid()


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: write the latest ring (if not written already), then die of
    the signal, as without this handler."""
    recorder = _latest() if _latest is not None else None
    if recorder is not None and recorder.dumped is None and os.getpid() == _armed_pid:
        recorder.dump(None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
