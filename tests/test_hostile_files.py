"""Files another user or process wrote, or prepared (issue 55).

Where a rank writes (FERROGRPC_TRACE, FERROGRPC_FLIGHT_DIR): symlinks
planted at the names it writes are never followed, and a directory of
another user, or one every user may write without the sticky bit, is
refused at start-up with a ConfigError naming it and why (see [Note: files
in a shared directory] in ferrogrpc/observe/files.py).

What ``ferrogrpc diagnose`` and ``ferrogrpc trace merge`` read: a flight
record or a trace file that is malformed or made to hurt (a world size of
two billion, keys missing, wrong types, JSON nested deeper than the parser
recurses, NaN, a FIFO) ends the command, through its real entry point,
quickly, with status 2 and one line naming the file and the field, never a
traceback (see [Note: records read as hostile] in
ferrogrpc/observe/schema.py).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrogrpc.env import Settings
from ferrogrpc.errors import ConfigError, Identity, PeerError
from ferrogrpc.observe import flight, trace
from ferrogrpc.observe.clock import ClockOffset
from ferrogrpc.testing import local_group

pytestmark = pytest.mark.timeout(60)

PRECIOUS = "the user's own file: nothing of ferrogrpc's may land here\n"
NOBODY = 65534


def _victims(tmp_path: Path, names: list[str], folder: Path) -> list[Path]:
    """A file of the user's outside ``folder`` for each of ``names``, and a
    symlink to it planted at that name in ``folder``, as another user
    would."""
    victims = []
    for i, name in enumerate(names):
        victim = tmp_path / f"victim{i}"
        victim.write_text(PRECIOUS)
        (folder / name).symlink_to(victim)
        victims.append(victim)
    return victims


def test_a_flight_dump_follows_no_planted_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "flight"
    folder.mkdir()
    monkeypatch.setattr(flight, "_dumps", itertools.count(0))
    name = f"flight-rank00001-pid{os.getpid()}-0.json"
    # The file's name and the name it used to be written under first.
    victims = _victims(tmp_path, [name, f".{name}.tmp"], folder)
    recorder = flight.FlightRecorder(Identity(1, 2, ["a:1", "b:1"]), str(folder))
    path = recorder.dump(PeerError("rank 0 died", peer=0))
    assert path == folder / name
    assert [v.read_text() for v in victims] == [PRECIOUS] * 2
    # The link at the record's name was replaced by the record itself.
    assert not path.is_symlink() and flight.load(path)["rank"] == 1


async def test_a_trace_follows_no_planted_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "trace"
    folder.mkdir()
    monkeypatch.setattr(trace, "_files", itertools.count(0))
    # Every name the two ranks' files could take in this process (each
    # takes one of the first two numbers), and the spool's and the temporary
    # file's names as they used to be.
    names = [
        f"trace-rank{r:05d}-pid{os.getpid()}-{n}.json"
        for r, n in itertools.product(range(2), [0, 1])
    ]
    planted = [*names, *(f".{n}.tmp" for n in names), *(f".{n}.spool0" for n in names)]
    victims = _victims(tmp_path, planted, folder)
    async with local_group(2, settings=Settings(trace_dir=str(folder))) as peers:
        await asyncio.gather(*(p.all_reduce(torch.ones(8)) for p in peers))
    assert [v.read_text() for v in victims] == [PRECIOUS] * len(victims)
    written = [folder / n for n in names if not (folder / n).is_symlink()]
    assert len(written) == 2
    ranks = {trace.load(p)["otherData"]["rank"] for p in written}
    assert ranks == {0, 1}


@pytest.mark.parametrize("setting", ["trace_dir", "flight_dir"])
@pytest.mark.parametrize("hazard", ["writable by all, no sticky bit", "another user's"])
async def test_an_unsafe_directory_is_refused_at_start(
    tmp_path: Path, setting: str, hazard: str
) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    if hazard == "another user's":
        assert os.geteuid() == 0, "needs root to give a directory away (CI runs as root)"
        os.chown(folder, NOBODY, NOBODY)
        folder.chmod(0o1777)  # /tmp's mode: the owner still decides
        why = f"belongs to uid {NOBODY}"
    else:
        folder.chmod(0o777)
        why = "no sticky bit"
    with pytest.raises(ConfigError) as caught:
        async with local_group(2, settings=Settings(**{setting: str(folder)})):
            pass
    message = str(caught.value)
    assert str(folder) in message and why in message, message
    variable = "FERROGRPC_TRACE" if setting == "trace_dir" else "FERROGRPC_FLIGHT_DIR"
    assert variable in message, message
    assert list(folder.iterdir()) == []


def test_a_flight_dump_into_a_directory_taken_since_start_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Missing at start (it passes then), made by another user before the
    # rank breaks: the dump is refused and logged, never raised.
    folder = tmp_path / "later"
    recorder = flight.FlightRecorder(Identity(0, 2, ["a:1", "b:1"]), str(folder))
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    assert recorder.dump(PeerError("rank 1 died", peer=1)) is None
    assert list(folder.iterdir()) == []
    assert f"belongs to uid {NOBODY}" in caplog.text


async def test_a_directory_of_ones_own_with_the_sticky_bit_is_used(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    folder.chmod(0o1777)
    async with local_group(2, settings=Settings(trace_dir=str(folder))) as peers:
        await asyncio.gather(*(p.all_reduce(torch.ones(8)) for p in peers))
    assert len(list(folder.glob("trace-rank*.json"))) == 2
    assert json.loads(next(folder.glob("trace-rank*.json")).read_text())["otherData"]


# ------------------------------------------------- diagnose and trace merge

COMMAND = str(Path(sys.executable).parent / "ferrogrpc")
# A regression that allocates per claimed rank fails fast, not by taking
# the machine's memory.
MEMORY_CAP = 2 << 30
DEEP = 100_000  # far past json.loads' recursion limit

Mutate = Callable[[dict[str, Any]], Any]


# The cap is set by a small program that then execs the command, not by a
# preexec_fn: that makes subprocess fork this process, whose gRPC (loaded
# by other tests) restarts its poller in the child, which then logs an
# epoll error on stderr as the child's descriptors are closed for exec.
CAPPED = (
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_CAP}, {MEMORY_CAP})); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _run(*args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED, COMMAND, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stderr, time.monotonic() - start


def _refused(args: list[str], file: Path, field: str) -> None:
    code, err, took = _run(*args)
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert str(file) in lines[0] and field in lines[0], (field, lines[0])
    assert took < 30, took


def _record() -> dict[str, Any]:
    """A real flight record: rank 1 of 2, broken in its second collective."""
    recorder = flight.FlightRecorder(Identity(1, 2, ["a:1", "b:1"]))
    for seq, state in ((0, flight.DONE), (1, flight.RUNNING)):
        entry = flight.Entry(seq, "all_reduce", 400, "float32")
        entry.path, entry.peers, entry.state = "ring", (0,), state
        entry.started = entry.ended = entry.called
        recorder.add(entry)
    snapshot: dict[str, Any] = recorder.snapshot(PeerError("rank 0 died", peer=0))
    return snapshot


def _set(key: str, value: object) -> Mutate:
    def mutate(d: dict[str, Any]) -> dict[str, Any]:
        d[key] = value
        return d

    return mutate


def _drop(key: str) -> Mutate:
    def mutate(d: dict[str, Any]) -> dict[str, Any]:
        del d[key]
        return d

    return mutate


def _drop_at(*keys: str) -> Mutate:
    """Drop the field at ``keys`` (a path of object keys; a number: a list's index)."""

    def mutate(d: dict[str, Any]) -> dict[str, Any]:
        inner: Any = d
        for key in keys[:-1]:
            inner = inner[int(key)] if key.isdigit() else inner[key]
        del inner[keys[-1]]
        return d

    return mutate


def _in_entry(key: str, value: object) -> Mutate:
    def mutate(d: dict[str, Any]) -> dict[str, Any]:
        d["entries"][0][key] = value
        return d

    return mutate


# (case, how the record is spoiled, the field the error must name); a str
# result is the file's text, anything else is written as JSON.
BAD_RECORDS: list[tuple[str, Mutate, str]] = [
    ("world size of 2e9", _set("world_size", 2e9), "world_size"),
    ("world size of two billion", _set("world_size", 2_000_000_000), "world_size"),
    ("rank beyond the world", _set("rank", 7), "rank"),
    ("no entries", _drop("entries"), "entries"),
    ("no world size", _drop("world_size"), "world_size"),
    ("no group", _drop("group"), "group"),
    ("an entry without its seq", _drop_at("entries", "0", "seq"), "entries[0].seq"),
    ("rank as a string", _set("rank", "1"), "rank"),
    ("entries as an object", _set("entries", {"0": {}}), "entries"),
    ("an entry as a number", _set("entries", [5]), "entries[0]"),
    ("seq as a list", _in_entry("seq", [1]), "entries[0].seq"),
    ("an unknown state", _in_entry("state", "exploded"), "entries[0].state"),
    ("peers as a string", _in_entry("peers", "0,1"), "entries[0].peers"),
    ("a billion peers", _in_entry("peers", [0] * 100_000), "entries[0].peers"),
    ("called as a string", _in_entry("called", "noon"), "entries[0].called"),
    ("cause as a string", _set("cause", "it broke"), "cause"),
    (
        "the cause naming no rank of the group",
        lambda d: d["cause"].update(peer=9) or d,
        "cause.peer",
    ),
    ("addresses of numbers", _set("addresses", [1, 2]), "addresses[0]"),
    (
        "a NaN time",
        lambda d: json.dumps(d).replace('"dumped_at": ', '"dumped_at": NaN, "x": '),
        "NaN",
    ),
    (
        "nested too deep",
        lambda d: '{"format": "ferrogrpc-flight/1", "entries": ' + "[" * DEEP + "]" * DEEP + "}",
        "nested too deeply",
    ),
    ("not JSON", lambda d: "{not json", "not JSON"),
    ("not UTF-8", lambda d: "\udcff", "not UTF-8"),
    ("a list at the top", lambda d: [d], "the top level"),
    ("a string at the top", lambda d: '"flight"', "the top level"),
    ("another format", _set("format", "ferrogrpc-flight/0"), "format"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "spoil", "field"), BAD_RECORDS, ids=[c for c, _, _ in BAD_RECORDS]
)
def test_diagnose_refuses_a_malformed_record_in_one_line(
    tmp_path: Path, case: str, spoil: Mutate, field: str
) -> None:
    folder = tmp_path / "flight"
    folder.mkdir()
    # A good record of the other rank beside it: the bad one is still named.
    (folder / "flight-rank00000-pid1-0.json").write_text(json.dumps(_record() | {"rank": 0}))
    bad = folder / "flight-rank00001-pid2-0.json"
    spoiled = spoil(copy.deepcopy(_record()))
    if isinstance(spoiled, str):
        bad.write_bytes(spoiled.encode("utf-8", "surrogateescape"))
    else:
        bad.write_text(json.dumps(spoiled))
    _refused(["diagnose", str(folder)], bad, field)


@pytest.mark.timeout(120)
def test_diagnose_refuses_a_fifo_and_records_that_disagree_without_waiting(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "fifo"
    folder.mkdir()
    fifo = folder / "flight-rank00000-pid1-0.json"
    os.mkfifo(fifo)  # nobody writes: a reader that opened it would wait forever
    _refused(["diagnose", str(folder)], fifo, "not a regular file")
    folder = tmp_path / "disagree"
    folder.mkdir()
    (folder / "flight-rank00000-pid1-0.json").write_text(json.dumps(_record() | {"rank": 0}))
    other = folder / "flight-rank00001-pid2-0.json"
    other.write_text(json.dumps(_record() | {"world_size": 3}))
    _refused(["diagnose", str(folder)], other, "world_size")
    # The good records still diagnose (the command works on them at all).
    (folder / "flight-rank00001-pid2-0.json").write_text(json.dumps(_record()))
    code, err, _ = _run("diagnose", str(folder))
    assert code in (0, 1) and not err, err


def _trace(tmp_path: Path) -> dict[str, Any]:
    """A real trace file: rank 1 of 2, one collective, a clock offset."""
    writer = trace.TraceWriter(Identity(1, 2, ["a:1", "b:1"]), str(tmp_path / "source"))
    writer.clock = ClockOffset(-0.5, 0.002, 8)
    entry = flight.Entry(0, "all_reduce", 400, "float32")
    entry.path, entry.peers, entry.state = "ring", (0,), flight.DONE
    entry.started = entry.called + 0.1
    entry.ended = entry.called + 0.2
    writer.collective(entry)
    writer.close()
    data: dict[str, Any] = json.loads(writer.path.read_text())
    return data


def _in_header(key: str, value: object) -> Mutate:
    def mutate(d: dict[str, Any]) -> dict[str, Any]:
        d["otherData"][key] = value
        return d

    return mutate


def _in_event(key: str, value: object) -> Mutate:
    def mutate(d: dict[str, Any]) -> dict[str, Any]:
        d["traceEvents"][-1][key] = value
        return d

    return mutate


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


BAD_TRACES: list[tuple[str, Mutate, str]] = [
    ("world size of 2e9", _in_header("world_size", 2e9), "otherData.world_size"),
    ("rank beyond the world", _in_header("rank", 5), "otherData.rank"),
    ("no events count", _drop_at("otherData", "events"), "otherData.events"),
    ("no header", _drop("otherData"), "otherData"),
    ("no events", _drop("traceEvents"), "traceEvents"),
    ("rank as a string", _in_header("rank", "1"), "otherData.rank"),
    ("clock as a list", _in_header("clock", [0.5]), "otherData.clock"),
    (
        "offset as a string",
        lambda d: d["otherData"]["clock"].update(offset_s="3") or d,
        "otherData.clock.offset_s",
    ),
    (
        "no offset",
        _drop_at("otherData", "clock", "offset_s"),
        "otherData.clock.offset_s",
    ),
    ("events as an object", _set("traceEvents", {}), "traceEvents"),
    ("an event as a string", lambda d: d["traceEvents"].append("X") or d, "traceEvents["),
    ("ts as a string", _in_event("ts", "soon"), ".ts"),
    ("args nested deep", _in_event("args", _nested(200)), ".args"),
    (
        "nested too deep",
        lambda d: '{"otherData": ' + "[" * DEEP + "]" * DEEP + "}",
        "nested too deeply",
    ),
    (
        "an infinite ts",
        lambda d: json.dumps(d).replace('"ts": ', '"ts": Infinity, "x": ', 1),
        "Infinity",
    ),
    ("not JSON", lambda d: '{"otherData": {', "not JSON"),
    ("a list at the top", lambda d: [d], "the top level"),
    ("a number at the top", lambda d: "5", "the top level"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "spoil", "field"), BAD_TRACES, ids=[c for c, _, _ in BAD_TRACES])
def test_trace_merge_refuses_a_malformed_file_in_one_line(
    tmp_path: Path, case: str, spoil: Mutate, field: str
) -> None:
    good = _trace(tmp_path)
    folder = tmp_path / "trace"
    folder.mkdir()
    (folder / "trace-rank00000-pid1-0.json").write_text(
        json.dumps(good | {"otherData": good["otherData"] | {"rank": 0, "clock": None}})
    )
    bad = folder / "trace-rank00001-pid2-0.json"
    spoiled = spoil(copy.deepcopy(good))
    bad.write_text(spoiled if isinstance(spoiled, str) else json.dumps(spoiled))
    out = tmp_path / "run.json"
    _refused(["trace", "merge", str(folder), "-o", str(out)], bad, field)
    assert not out.exists()
