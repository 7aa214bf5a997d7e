"""The flight recorder and ``ferrogrpc diagnose`` (issue 32, item 4).

A rank stalled with SIGSTOP before a collective is named from the ranks'
dumps alone, even after it wakes and writes its own record naming someone
else; the ring stays bounded; a healthy run writes nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.env import Settings
from ferrogrpc.observe import diagnose, flight
from ferrogrpc.runtime.peer import observer_of
from tests.helpers import free_port, rank_env, spawn_rank, wait_until

WORLD = 4
VICTIM = 2
STOP_STEP = 3


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferrogrpc.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(120)
def test_a_rank_stopped_before_a_collective_is_named_from_the_dumps_alone(
    tmp_path: Path,
) -> None:
    flight_dir = tmp_path / "flight"
    port = free_port()
    env = {"FERROGRPC_FLIGHT_DIR": str(flight_dir), "FERROGRPC_SHM": "0"}
    procs = [
        spawn_rank(
            "flight_stall.py",
            str(VICTIM),
            str(STOP_STEP),
            str(tmp_path),
            env=rank_env(rank, WORLD, port, **env),
        )
        for rank in range(WORLD)
    ]
    try:
        # The others give up on the stopped rank (idle timeout 1 s) and dump.
        wait_until(
            lambda: len(list(flight_dir.glob("flight-rank*.json"))) >= WORLD - 1,
            40,
            "the others' flight records",
        )
        survivors = {json.loads(p.read_text())["rank"] for p in flight_dir.glob("flight-*.json")}
        assert survivors == set(range(WORLD)) - {VICTIM}, survivors
        # The diagnosis from the survivors' dumps: the victim left none.
        early = _cli("diagnose", str(flight_dir), "--json")
        assert early.returncode == 0, early.stderr
        [verdict] = json.loads(early.stdout)
        assert verdict["culprit"] == VICTIM, verdict
        # Wake it: it calls the all-reduce late, fails, and dumps too.
        procs[VICTIM].send_signal(signal.SIGCONT)
        wait_until(
            lambda: len(list(flight_dir.glob("flight-rank*.json"))) >= WORLD,
            40,
            "the woken victim's flight record",
        )
        (tmp_path / "release").write_text("")
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        procs[VICTIM].send_signal(signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = [
        json.loads(line[len("RESULT ") :])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(results) == WORLD, outputs
    assert all(r["type"] != "none" for r in results), results

    done = _cli("diagnose", str(flight_dir), "--json")
    assert done.returncode == 0, done.stderr
    [verdict] = json.loads(done.stdout)
    assert verdict["culprit"] == VICTIM, verdict
    assert verdict["ranks_with_records"] == list(range(WORLD))
    # The collective waited on is the stop step's bucket all-reduce: every
    # step before it ran one DDP all-reduce (after init's collectives).
    assert verdict["op"] == "all_reduce", verdict
    places = {v["rank"]: v["place"] for v in verdict["views"]}
    # Woken, it either called the all-reduce after the others had given up,
    # or learnt of the failure (their report) before it called it.
    assert places[VICTIM] in ("reached late", "never reached"), places
    assert all(places[r] == "in time" for r in range(WORLD) if r != VICTIM), places
    # Every survivor's record shows the same seq still running.
    records = [flight.load(p) for p in sorted(flight_dir.glob("flight-*.json"))]
    for rec in records:
        if rec["rank"] == VICTIM:
            continue
        running = [e for e in rec["entries"] if e["state"] == flight.RUNNING and e["seq"] >= 0]
        assert running and running[0]["seq"] == verdict["seq"], (rec["rank"], running)
    text = _cli("diagnose", str(flight_dir))
    assert f"culprit: rank {VICTIM}" in text.stdout, text.stdout
    assert f"all_reduce#{verdict['seq']}" in text.stdout, text.stdout
    print(text.stdout)


def _record(
    rank: int,
    world: int,
    entries: list[dict[str, object]],
    cause_peer: int | None,
    dumped_at: float,
) -> dict[str, object]:
    return {
        "format": flight.FORMAT,
        "rank": rank,
        "world_size": world,
        "addresses": [f"h:{i}" for i in range(world)],
        "group": "g",
        "host": "h",
        "pid": rank,
        "dumped_at": dumped_at,
        "cause": {
            "kind": "PeerError",
            "message": "x",
            "op": "all_reduce",
            "seq": 5,
            "peer": cause_peer,
            "evidence": "symptom",
        },
        "entries": entries,
    }


def _entry(seq: int, state: str, called: float, ended: float = 0.0) -> dict[str, object]:
    e = flight.Entry(seq, "all_reduce", 64, "float32")
    e.state, e.called, e.started, e.ended = state, called, called, ended
    return e.as_dict()


@pytest.mark.timeout(30)
def test_diagnosis_rules_on_crafted_records() -> None:
    # Rank 1 never called seq 5 (its record ends at 4, done): named, though
    # rank 0's error (a symptom) names rank 2.
    t = 1000.0
    done4 = [_entry(4, flight.DONE, t, t + 1)]
    records = [
        _record(0, 3, [*done4, _entry(5, flight.RUNNING, t + 2)], 2, t + 10),
        _record(1, 3, done4, 0, t + 11),
        _record(2, 3, [*done4, _entry(5, flight.RUNNING, t + 2)], 1, t + 10),
    ]
    d = diagnose.diagnose(records)
    assert (d.culprit, d.op, d.seq) == (1, "all_reduce", 5), d
    assert d.views[1].place == "never reached"
    # Every rank reached it, rank 2 left no record: rank 2, named by the others.
    records = [
        _record(0, 3, [*done4, _entry(5, flight.RUNNING, t + 2)], 2, t + 10),
        _record(1, 3, [*done4, _entry(5, flight.RUNNING, t + 2)], 2, t + 10),
    ]
    d = diagnose.diagnose(records)
    assert d.culprit == 2 and d.views[2].place == "no record", d
    # Two ranks without records: the one the errors name.
    records = [_record(0, 3, [*done4, _entry(5, flight.RUNNING, t + 2)], 1, t + 10)]
    assert diagnose.diagnose(records).culprit == 1


@pytest.mark.timeout(30)
def test_diagnose_refuses_an_empty_or_foreign_directory(tmp_path: Path) -> None:
    missing = _cli("diagnose", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    empty = _cli("diagnose", str(tmp_path))
    assert empty.returncode == 2 and "no flight records" in empty.stderr
    (tmp_path / "flight-rank00000-pid1-0.json").write_text('{"hello": 1}')
    foreign = _cli("diagnose", str(tmp_path))
    assert foreign.returncode == 2 and "not a ferrogrpc flight record" in foreign.stderr


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("own", [False, True], ids=["default", "own-handler"])
def test_a_rank_stopped_by_sigterm_writes_its_record(tmp_path: Path, own: bool) -> None:
    # A launcher stops the other ranks once one failed: a rank stalled in
    # the user's code, SIGTERMed before it heard of the failure, still
    # leaves the record diagnose needs, and dies of the signal as before. A
    # program's own SIGTERM handler is left alone.
    port = free_port()
    env = {"FERROGRPC_FLIGHT_DIR": str(tmp_path), "FERROGRPC_SHM": "0"}
    args = ["own"] if own else []
    procs = [
        spawn_rank("flight_term.py", *args, env=rank_env(rank, 2, port, **env)) for rank in (0, 1)
    ]
    try:
        wait_until(lambda: all("ready" in p.stdout for p in procs), 60, "both ranks ready")
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(30) for p in procs]
    finally:
        for p in procs:
            p.kill()
    records = sorted(tmp_path.glob("flight-rank*.json"))
    if own:
        assert codes == [3, 3] and records == [], (codes, records)
        return
    assert codes == [-signal.SIGTERM] * 2, codes
    assert [r.name[:16] for r in records] == ["flight-rank00000", "flight-rank00001"]
    for record in records:
        d = json.loads(record.read_text())
        assert d["cause"] is None
        assert [(e["op"], e["state"]) for e in d["entries"]][-2:] == [
            ("all_reduce", flight.DONE),
            ("all_reduce", flight.DONE),
        ], d["entries"]


def test_the_ring_is_bounded_and_a_healthy_run_writes_nothing(tmp_path: Path) -> None:
    async def run() -> list[flight.Entry]:
        settings = Settings(flight_dir=str(tmp_path))
        async with fg.testing.local_group(2, settings=settings) as peers:
            for _ in range(flight.FLIGHT_ENTRIES + 10):
                await asyncio.gather(*(p.all_reduce(torch.ones(4)) for p in peers))
            return observer_of(peers[0]).flight.entries()

    entries = asyncio.run(run())
    assert len(entries) == flight.FLIGHT_ENTRIES
    seqs = [e.seq for e in entries]
    assert seqs == list(range(seqs[0], seqs[0] + flight.FLIGHT_ENTRIES))
    assert all(e.state == flight.DONE and e.op == "all_reduce" for e in entries)
    assert all(e.called <= e.started <= e.ended for e in entries)
    assert not list(tmp_path.iterdir())  # nothing broke: no dump


def _blaming(
    rank: int,
    world: int,
    entries: list[dict[str, object]],
    peer: int | None,
    evidence: str,
    dumped_at: float,
) -> dict[str, object]:
    record = _record(rank, world, entries, peer, dumped_at)
    cause = record["cause"]
    assert isinstance(cause, dict)
    cause["evidence"] = evidence
    return record


@pytest.mark.timeout(30)
def test_of_two_late_ranks_the_one_whose_last_progress_is_oldest_is_named() -> None:
    # Issue 56 item 15. Ranks 2 and 3 both finished seq 4 and never called
    # seq 5, which ranks 0 and 1 wait in. Rank 3 finished it first and has
    # stalled longest: it is the culprit, though it is the higher rank and
    # the errors name rank 2.
    t = 1000.0
    in_it = [_entry(4, flight.DONE, t, t + 3), _entry(5, flight.RUNNING, t + 4)]
    records = [
        _record(0, 4, in_it, 2, t + 9),
        _record(1, 4, in_it, 2, t + 9),
        _record(2, 4, [_entry(4, flight.DONE, t, t + 3)], 3, t + 10),
        _record(3, 4, [_entry(4, flight.DONE, t, t + 1)], 2, t + 10),
    ]
    for order in (records, records[::-1]):
        d = diagnose.diagnose(order)
        assert (d.seq, d.culprit) == (5, 3), d
        assert [v.place for v in d.views[2:]] == ["never reached", "never reached"], d
        assert "all_reduce#4" in d.reason, d.reason


@pytest.mark.timeout(30)
def test_the_collective_waited_on_is_the_lowest_seq_some_rank_did_not_finish() -> None:
    # Issue 56 item 16. Rank 0's first unfinished collective is seq 6, rank
    # 1's is seq 5: the group waits on seq 5 (rank 0 finished it, rank 1 is
    # still in it), and rank 2, which never called seq 5, is named.
    t = 1000.0
    done4 = _entry(4, flight.DONE, t, t + 1)
    past_it = [done4, _entry(5, flight.DONE, t + 2, t + 3), _entry(6, flight.RUNNING, t + 4)]
    records = [
        _record(0, 3, past_it, 2, t + 9),
        _record(1, 3, [done4, _entry(5, flight.RUNNING, t + 2)], 2, t + 9),
        _record(2, 3, [done4], 1, t + 10),
    ]
    for order in (records, records[::-1]):
        d = diagnose.diagnose(order)
        assert (d.op, d.seq, d.culprit) == ("all_reduce", 5, 2), d
        assert [v.place for v in d.views] == ["in time", "in time", "never reached"], d


@pytest.mark.timeout(30)
def test_a_cause_found_outweighs_several_symptoms_in_the_vote() -> None:
    # Issue 56 item 17. Every rank reached seq 5 in time (bad data): rank 0
    # found rank 3 at fault, while ranks 1 and 3 saw only symptoms, which
    # name rank 2. One finding outweighs the two symptoms.
    t = 1000.0
    run = [_entry(4, flight.DONE, t, t + 1), _entry(5, flight.RUNNING, t + 2)]
    records = [
        _blaming(0, 4, run, 3, "found", t + 9),
        _blaming(1, 4, run, 2, "symptom", t + 9),
        _blaming(2, 4, run, None, "symptom", t + 9),
        _blaming(3, 4, run, 2, "symptom", t + 9),
    ]
    d = diagnose.diagnose(records)
    assert all(v.place == "in time" for v in d.views), d
    assert d.culprit == 3, d


@pytest.mark.timeout(60)
def test_a_real_runs_records_name_the_rank_the_error_blames(tmp_path: Path) -> None:
    # Issue 56 item 20. Rank 1 corrupts its first all-reduce chunk: every
    # rank breaks, and each rank's record names rank 1 (the rank its error
    # blames), not the rank that wrote the record.
    fault = fg.testing.Fault(
        rank=1, kind=fg.testing.FaultKind.CORRUPT_PAYLOAD, nth=0, collective="all_reduce"
    )

    async def run() -> list[BaseException | None]:
        settings = Settings(flight_dir=str(tmp_path))
        async with fg.testing.local_group(
            3, settings=settings, direct=False, faults=[fault]
        ) as peers:
            results = await asyncio.gather(
                *(p.all_reduce(torch.ones(3 << 18)) for p in peers), return_exceptions=True
            )
            return [r if isinstance(r, BaseException) else None for r in results]

    errors = asyncio.run(run())
    assert all(isinstance(e, fg.FerroGrpcError) and e.peer == 1 for e in errors), errors
    (records,) = diagnose.read(tmp_path).values()
    causes = {r["rank"]: r["cause"] for r in records}
    assert sorted(causes) == [0, 1, 2], causes
    for rank, cause in causes.items():
        assert cause is not None and cause["peer"] == 1, (rank, cause)
    assert causes[2]["evidence"] == "found", causes[2]
    assert diagnose.diagnose(records).culprit == 1
