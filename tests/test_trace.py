"""The trace (FERROGRPC_TRACE=DIR) and ``ferrogrpc trace merge``.

A traced run (three ranks in this process: DDP steps, plain collectives, an
FSDP step with units) is merged, and the merged file is checked against
what the run did: every rank present; every collective on every rank with
the same op and size; across ranks, no rank's collective ends before every
rank has started it (within the measured clock bound); on each rank, call
order is sequence order; the DDP buckets and their waits, and the FSDP
units' waits, with their sizes computed from the models. A run in two
processes whose rank 1 clock is 5 s ahead checks that the measured offset
realigns it (and that without it, the order check fails). The offset
arithmetic, the memory bound, and the command's errors are checked on
their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import math
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ferrogrpc as fg
from ferrogrpc.cli import main as cli_main
from ferrogrpc.env import Settings
from ferrogrpc.errors import Identity, PeerError
from ferrogrpc.observe import trace
from ferrogrpc.observe.clock import ClockOffset, measure, offset_from
from ferrogrpc.observe.flight import Entry
from ferrogrpc.runtime.peer import observer_of
from ferrogrpc.testing import local_group
from ferrogrpc.transport import grpc_streams
from tests.helpers import backends, on_ranks, run_ranks

pytestmark = pytest.mark.timeout(240)

US = 1e6
# Wall-clock microseconds (about 1.8e15) are doubles: a quarter of a
# microsecond apart. Two of those steps, with room.
ROUNDING_US = 1.0


# --------------------------------------------------------------- helpers


def _merge(directory: Path, out: Path) -> dict[str, Any]:
    assert cli_main(["trace", "merge", str(directory), "-o", str(out)]) == 0
    merged: dict[str, Any] = json.loads(out.read_text())
    return merged


def _slices(merged: dict[str, Any], cat: str) -> dict[int, list[dict[str, Any]]]:
    """The X events of category ``cat``, by rank (pid), in file order."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in merged["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == cat:
            out[e["pid"]].append(e)
    return out


def _collectives(merged: dict[str, Any]) -> dict[int, dict[int, dict[str, Any]]]:
    """Each rank's collectives (not sends and receives), by seq."""
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, events in _slices(merged, "collective").items():
        seqs = [e for e in events if e["args"]["seq"] >= 0]
        by_rank[rank] = {e["args"]["seq"]: e for e in seqs}
        assert len(by_rank[rank]) == len(seqs), f"rank {rank}: a seq traced twice"
    return by_rank


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"] + e["dur"])


def _bound_us(merged: dict[str, Any]) -> float:
    """How far two ranks' aligned clocks may disagree: the two largest
    error bounds (each rank is within its own of rank 0's clock; one that
    measured none counts as exact)."""
    files = merged["otherData"]["files"]
    bounds = sorted(f["clock"]["error_bound_s"] if f["clock"] else 0.0 for f in files)
    return sum(bounds[-2:]) * US + ROUNDING_US


def _causality_violations(merged: dict[str, Any]) -> list[str]:
    """Collectives some rank ended before another rank started it (beyond
    the clock bound)."""
    runs = {
        rank: {e["args"]["seq"]: e for e in events}
        for rank, events in _slices(merged, "collective.run").items()
    }
    colls = _collectives(merged)
    bound = _bound_us(merged)
    wrong = []
    for seq in colls[0]:
        last_start = max(runs[r][seq]["ts"] for r in colls)
        first_end = min(_end(colls[r][seq]) for r in colls)
        if last_start > first_end + bound:
            wrong.append(f"seq {seq}: a rank ended {last_start - first_end:.1f} us early")
    return wrong


def _bucket_bytes(model: nn.Module, layout: list[list[str]]) -> list[int]:
    """A DDP bucket's buffer: its gradients and one flag per parameter."""
    params = dict(model.named_parameters())
    return [(sum(params[n].numel() for n in names) + len(names)) * 4 for names in layout]


# ---------------------------------------------------------- a traced run


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )  # fmt: skip


def test_a_traced_run_merges_into_one_timeline_in_causal_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "trace"
    monkeypatch.setenv("FERROGRPC_TRACE", str(folder))
    monkeypatch.delenv("FERROGRPC_METRICS_PORT", raising=False)
    world, steps = 3, 3
    torch.manual_seed(0)
    template = _mlp()
    group = backends(world)

    def run(rank: int) -> tuple[list[list[str]], list[tuple[str, list[str]]]]:
        backend = group[rank]
        ddp = fg.DDP(copy.deepcopy(template), backend, bucket_size_bytes=600)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            nn.functional.mse_loss(ddp(x), y).backward()
            ddp.sync_gradients()
        backend.all_reduce(torch.ones(300_000))  # not small: shared memory
        backend.broadcast(torch.arange(10.0), root=2)
        backend.all_gather(torch.full((5,), float(rank)))
        backend.barrier()
        fsdp = fg.FSDP(copy.deepcopy(template), backend, units={nn.Linear})
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        fsdp(x).sum().backward()
        fsdp.sync_gradients()
        return ddp.bucket_layout(), fsdp.unit_layout()

    try:
        results = on_ranks(run, world)
    finally:
        for backend in group:
            backend.close()
    layout, units = results[0]

    # One file per rank, written at close (complete), its spool gone.
    files = sorted(p.name for p in folder.iterdir())
    assert files == [f"trace-rank{r:05d}-pid{os.getpid()}-{n}.json" for r, n in _numbers(files)]
    assert [r for r, _ in _numbers(files)] == list(range(world))
    for name in files:
        header = json.loads((folder / name).read_text())["otherData"]
        assert header["complete"] and header["world_size"] == world and header["dropped"] == 0
        assert header["pid"] == os.getpid() and header["host"]

    merged = _merge(folder, tmp_path / "run.json")
    assert merged["otherData"]["ranks"] == list(range(world))
    assert merged["otherData"]["unaligned_ranks"] == []
    names = {
        e["pid"]: e["args"]["name"]
        for e in merged["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {r: f"rank {r}" for r in range(world)}
    # One clock in one process: the true offset is 0, so each measured one
    # is within its own bound of 0.
    for f in merged["otherData"]["files"]:
        clock = ClockOffset.from_dict(f["clock"])
        assert abs(clock.offset) <= clock.error_bound + 1e-6, f
        assert clock.samples == (0 if f["rank"] == 0 else 8)

    # Every collective on every rank, alike.
    colls = _collectives(merged)
    assert sorted(colls) == list(range(world))
    seqs = sorted(colls[0])
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # none missing
    for rank in range(1, world):
        assert sorted(colls[rank]) == seqs, f"rank {rank}"
        for seq in seqs:
            mine, theirs = colls[rank][seq]["args"], colls[0][seq]["args"]
            for key in ("op", "bytes", "dtype", "path"):
                assert mine[key] == theirs[key], (rank, seq, key, mine, theirs)
    assert _causality_violations(merged) == []

    # Each collective: waiting for its turn, then its run, in one lane;
    # call order is sequence order.
    waits = {
        r: {e["args"]["seq"]: e for e in v} for r, v in _slices(merged, "collective.wait").items()
    }
    runs = {
        r: {e["args"]["seq"]: e for e in v} for r, v in _slices(merged, "collective.run").items()
    }
    for rank in range(world):
        called = [colls[rank][s]["ts"] for s in seqs]
        assert called == sorted(called), f"rank {rank}: seq order is not call order"
        for seq in seqs:
            whole, wait, ran = colls[rank][seq], waits[rank][seq], runs[rank][seq]
            assert whole["tid"] == wait["tid"] == ran["tid"]
            assert wait["ts"] == whole["ts"]
            assert abs(wait["ts"] + wait["dur"] - ran["ts"]) <= ROUNDING_US
            assert abs(_end(ran) - _end(whole)) <= ROUNDING_US
            assert ran["name"] == whole["args"]["path"]
    # Lanes: slices in one lane never overlap.
    lanes: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in merged["traceEvents"]:
        if e["ph"] == "X" and e["cat"] in ("collective", "ddp.bucket", "ddp.bucket_wait"):
            lanes[(e["pid"], e["tid"])].append(e)
    for key, events in lanes.items():
        events.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(events):
            assert b["ts"] >= _end(a) - ROUNDING_US, (key, a, b)

    # What the run did: the big all-reduce, the broadcast, the gather.
    ops = [(colls[0][s]["args"]["op"], colls[0][s]["args"]["bytes"]) for s in seqs]
    assert ("all_reduce", 1_200_000) in ops and ("broadcast", 40) in ops
    assert ("all_gather", world * 5 * 4) in ops and ("barrier", world * 4) in ops

    # DDP: every bucket of every step, in bucket order, with its wait; the
    # bucket's span holds its all-reduce, and its wait ends after it.
    sizes = _bucket_bytes(template, layout)
    for rank in range(world):
        ddp_reduces = [
            colls[rank][s]
            for s in seqs
            if colls[rank][s]["args"]["op"] == "all_reduce"
            and colls[rank][s]["args"]["bytes"] in sizes
        ]
        assert [e["args"]["bytes"] for e in ddp_reduces] == sizes * steps, rank
        buckets = sorted(_slices(merged, "ddp.bucket")[rank], key=lambda e: e["ts"])
        bucket_waits = sorted(_slices(merged, "ddp.bucket_wait")[rank], key=lambda e: e["ts"])
        expected = [b for _ in range(steps) for b in range(len(layout))]
        assert [e["args"]["bucket"] for e in buckets] == expected
        assert [e["args"]["bucket"] for e in bucket_waits] == expected
        for span, wait, coll in zip(buckets, bucket_waits, ddp_reduces, strict=True):
            assert span["args"]["bytes"] == wait["args"]["bytes"] == coll["args"]["bytes"]
            assert span["ts"] <= coll["ts"] + ROUNDING_US
            assert _end(span) >= _end(coll) - 100  # a stamp turned into wall time
            assert _end(wait) >= _end(coll) - ROUNDING_US

    # FSDP: each unit's gather waited for, and the reduce-scatters.
    fsdp_params = dict(template.named_parameters())
    for rank in range(world):
        gathers = _slices(merged, "fsdp.gather_wait")[rank]
        reduces = _slices(merged, "fsdp.reduce_wait")[rank]
        for unit, params in units:
            if not params:
                continue
            full = sum(math.ceil(fsdp_params[p].numel() / world) * world * 4 for p in params)
            mine = [e for e in gathers if e["args"]["unit"] == unit]
            assert mine and all(e["args"]["bytes"] == full for e in mine), (unit, gathers)
            assert {e["args"]["param"] for e in reduces if e["args"]["unit"] == unit} == set(params)


def _numbers(files: list[str]) -> list[tuple[int, int]]:
    """(rank, group number) of each trace file name."""
    out = []
    for name in files:
        stem = name.removesuffix(".json").split("-")
        out.append((int(stem[1].removeprefix("rank")), int(stem[3])))
    return out


def test_tracing_off_writes_nothing_and_adds_no_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FERROGRPC_TRACE", raising=False)
    monkeypatch.delenv("FERROGRPC_METRICS_PORT", raising=False)
    monkeypatch.chdir(tmp_path)
    group = backends(2)
    try:
        for backend in group:
            observer = observer_of(backend.peer)
            assert trace.writer_of(observer) is None
            assert observer.collective_sinks == [] and observer.span_sinks == []
            assert isinstance(observer.span("x", "y"), contextlib.nullcontext)
        on_ranks(lambda r: group[r].all_reduce(torch.ones(1000)), 2)
    finally:
        for backend in group:
            backend.close()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ clocks


def test_the_offset_is_the_shortest_round_trips_midpoint() -> None:
    # Rank 0's clock reads 2.5 s ahead. Each sample: sent at t0 (local),
    # answered d1 later (remote clock), back d2 after that.
    true = 2.5
    samples = []
    for t0, d1, d2 in [(10.0, 0.004, 0.001), (11.0, 0.0002, 0.0003), (12.0, 0.001, 0.009)]:
        samples.append((t0, t0 + d1 + true, t0 + d1 + d2))
    clock = offset_from(samples)
    # The second sample (round trip 0.5 ms) is kept: offset = t1 - midpoint.
    assert clock.round_trip == pytest.approx(0.0005)
    assert clock.offset == pytest.approx(true + (0.0002 - 0.0003) / 2)
    assert abs(clock.offset - true) <= clock.error_bound
    assert clock.samples == 3
    with pytest.raises(ValueError):
        offset_from([])


async def test_a_rank_measures_rank_0s_clock_over_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    async with local_group(2) as peers:
        transport = peers[1]._parts.ctx.transport
        # Rank 0's server answers pings with a clock 7 s ahead (both ranks'
        # servers do: rank 1 only asks rank 0).
        real = grpc_streams.time.time

        class Ahead:
            @staticmethod
            def time() -> float:
                return real() + 7.0

        monkeypatch.setattr(grpc_streams, "time", Ahead)
        clock = await measure(transport, 1, timeout=5.0)
        assert clock is not None and clock.samples == 8
        assert abs(clock.offset - 7.0) <= clock.error_bound + 1e-5, clock
        assert 0 < clock.round_trip < 1.0
        assert await measure(transport, 0, timeout=5.0) == ClockOffset(0.0, 0.0, 0)
        # A rank 0 that does not answer is the transport's error.
        await peers[0].close()
        with pytest.raises(PeerError):
            await measure(transport, 1, timeout=1.0)


def _entry(seq: int, called: float, started: float, ended: float) -> Entry:
    e = Entry(seq, "all_reduce", 64, "float32")
    e.path, e.peers, e.state = "ring", (1,), "done"
    e.called, e.started, e.ended = called, started, ended
    return e


def test_merge_moves_each_rank_onto_rank_0s_clock(tmp_path: Path) -> None:
    # Two ranks run seq 0 and 1 at the same true times; rank 1's clock reads
    # 3 s ahead, and it measured -3 s (+- 1 ms). Merged, rank 1's events are
    # at the true times; without the offset they are 3 s late, and the order
    # check fails.
    true = [(1000.0, 1000.1, 1000.5), (1001.0, 1001.2, 1001.3)]
    addresses = ["a:1", "b:2"]
    for skewed in (True, False):
        folder = tmp_path / f"skewed-{skewed}"
        writers = [trace.TraceWriter(Identity(r, 2, addresses), str(folder)) for r in range(2)]
        writers[1].clock = ClockOffset(-3.0, 0.002, 8) if skewed else None
        for seq, (c, s, e) in enumerate(true):
            writers[0].collective(_entry(seq, c, s, e))
            writers[1].collective(_entry(seq, c + 3.0, s + 3.0, e + 3.0))
        for w in writers:
            w.close()
        merged = _merge(folder, tmp_path / f"merged-{skewed}.json")
        colls = _collectives(merged)
        for seq, (c, _, e) in enumerate(true):
            assert colls[0][seq]["ts"] == pytest.approx(c * US, abs=ROUNDING_US)
            moved = c * US if skewed else (c + 3.0) * US
            assert colls[1][seq]["ts"] == pytest.approx(moved, abs=ROUNDING_US)
            assert colls[1][seq]["dur"] == pytest.approx((e - c) * US, abs=ROUNDING_US)
        if skewed:
            assert merged["otherData"]["unaligned_ranks"] == []
            assert _causality_violations(merged) == []
        else:
            assert merged["otherData"]["unaligned_ranks"] == [1]
            assert len(_causality_violations(merged)) == 2


def test_two_processes_with_a_skewed_clock_line_up(tmp_path: Path) -> None:
    # Rank 1's process reads a clock 5 s ahead. Neither closes its backend:
    # the files are written at interpreter exit.
    folder = tmp_path / "trace"
    outputs = run_ranks(
        "trace_skew.py",
        2,
        "1",
        "5.0",
        timeout=200,
        env={"FERROGRPC_TRACE": str(folder)},
        fresh=True,
    )
    assert all(f"OK rank {r}" in out for r, out in enumerate(outputs)), outputs
    files = sorted(folder.iterdir())
    assert [p.name.split("-")[1] for p in files] == ["rank00000", "rank00001"], files
    headers = [json.loads(p.read_text())["otherData"] for p in files]
    assert not any(h["complete"] for h in headers)  # written at exit, not at close
    clock = ClockOffset.from_dict(headers[1]["clock"])
    assert abs(clock.offset + 5.0) <= clock.error_bound + 1e-5, clock
    merged = _merge(folder, tmp_path / "run.json")
    colls = _collectives(merged)
    assert sorted(colls[0]) == sorted(colls[1]) and len(colls[0]) > 10
    assert _causality_violations(merged) == []
    assert len(_slices(merged, "ddp.bucket")[1]) == 3 * int(outputs[1].split()[-1])
    # The same files without rank 1's offset: its events sit 5 s late, and
    # rank 0 seems to finish every collective before rank 1 starts it.
    unaligned = tmp_path / "unaligned"
    shutil.copytree(folder, unaligned)
    data = json.loads(files[1].read_text())
    data["otherData"]["clock"] = None
    (unaligned / files[1].name).write_text(json.dumps(data))
    wrong = _merge(unaligned, tmp_path / "wrong.json")
    assert wrong["otherData"]["unaligned_ranks"] == [1]
    assert len(_causality_violations(wrong)) == len(colls[0])


# ---------------------------------------------------------- the file itself


async def test_a_rank_that_breaks_writes_its_trace_before_it_closes(tmp_path: Path) -> None:
    settings = Settings(trace_dir=str(tmp_path))
    async with local_group(2, settings=settings) as peers:
        writer = trace.writer_of(observer_of(peers[0]))
        assert writer is not None and writer.clock is not None
        await asyncio.gather(*(p.all_reduce(torch.ones(10)) for p in peers))
        await peers[1].close()
        with pytest.raises(PeerError):
            await peers[0].all_reduce(torch.ones(10))
        assert writer.writing is not None
        writer.writing.join(30)
        # Written at the break (in its own thread): what had ended by then,
        # the good all-reduce at least, while the peer is still open.
        data = json.loads(writer.path.read_text())
        assert data["otherData"]["complete"] is False
        ended = [e["args"] for e in data["traceEvents"] if e.get("cat") == "collective"]
        assert ("all_reduce", 40, "done") in [(a["op"], a["bytes"], a["state"]) for a in ended]
    # Written again at close: the failed collective too, and whom it blamed.
    data = json.loads(writer.path.read_text())
    assert data["otherData"]["complete"] is True
    last = [e["args"] for e in data["traceEvents"] if e.get("cat") == "collective"][-1]
    assert (last["op"], last["state"], last["error"], last["culprit"]) == (
        "all_reduce",
        "failed",
        "PeerError",
        1,
    )


def test_memory_stays_bounded_and_the_file_keeps_the_last_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace, "FLUSH_EVENTS", 10)
    monkeypatch.setattr(trace, "SEGMENT_EVENTS", 60)
    writer = trace.TraceWriter(Identity(0, 1, ["a:1"]), str(tmp_path))
    n = 400  # three events each: 1200
    for seq in range(n):
        writer.collective(_entry(seq, 100.0 + seq, 100.2 + seq, 100.5 + seq))
        assert len(writer._buffer) < 10
    # A break writes the file (the run may end there); events go on.
    writer.broke(PeerError("rank 1 died", peer=1))
    assert writer.writing is not None
    writer.writing.join(30)
    broke = json.loads(writer.path.read_text())
    assert broke["otherData"]["complete"] is False
    writer.close()
    data = json.loads(writer.path.read_text())
    header = data["otherData"]
    kept = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert header["complete"] is True
    assert header["events"] == len(kept) and header["dropped"] + len(kept) == 3 * n
    assert 60 <= len(kept) <= 2 * 60 + 10  # two segments, at most, and a buffer
    seqs = sorted({e["args"]["seq"] for e in kept})
    assert seqs[-1] == n - 1 and seqs == list(range(seqs[0], n))  # the last ones
    assert sorted(p.name for p in tmp_path.iterdir()) == [writer.path.name]  # no spool left
    writer.collective(_entry(n, 1.0, 2.0, 3.0))  # after close: ignored
    assert json.loads(writer.path.read_text()) == data


def test_merge_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "run.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["trace", "merge", str(empty), "-o", out]) == 2
    assert "no trace files" in capsys.readouterr().err
    assert cli_main(["trace", "merge", str(tmp_path / "missing"), "-o", out]) == 2
    assert "not a directory" in capsys.readouterr().err
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "trace-rank00000-pid1-0.json").write_text(json.dumps({"traceEvents": []}))
    assert cli_main(["trace", "merge", str(wrong), "-o", out]) == 2
    assert "not a ferrogrpc trace file" in capsys.readouterr().err
    (wrong / "trace-rank00000-pid1-0.json").write_text("{not json")
    assert cli_main(["trace", "merge", str(wrong), "-o", out]) == 2
    assert "not a readable trace file" in capsys.readouterr().err
    assert not Path(out).exists()
