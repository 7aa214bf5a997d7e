"""The benchmark's ``ok`` column checks the whole result: a wrong element
in the middle of the tensor, first and last right, is a ``NO``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client.bench import result_ok
from client.bench_latency import START_WORDS
from tests.helpers import ROOT, clean_env

# Loaded by every Python process of the bench run below (sitecustomize on
# PYTHONPATH): after each blocking ferrogrpc all_reduce of at least 16Ki
# elements, one element in the middle of the result is off by one.
CORRUPT_MIDDLE = """
import ferrogrpc

_all_reduce = ferrogrpc.Backend.all_reduce


def all_reduce(self, tensor, *args, **kwargs):
    result = _all_reduce(self, tensor, *args, **kwargs)
    if not kwargs.get("async_op") and tensor.numel() >= 16384:
        tensor[tensor.numel() // 2] += 1
    return result


ferrogrpc.Backend.all_reduce = all_reduce
"""


def test_result_ok_checks_every_element() -> None:
    t = torch.full((1001,), 8.0)
    assert result_ok(t, 8.0)
    for wrong in (7.0, float("nan"), float("inf")):
        t[500] = wrong
        assert t[0].item() == t[-1].item() == 8.0
        assert not result_ok(t, 8.0), wrong
        t[500] = 8.0


def _run_bench(
    tmp_path: Path, module: str, corrupt: str | None, *args: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module`` at world 2, one iteration, no warmup; with
    ``corrupt``, that sitecustomize is loaded by every process of the run."""
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT)
    if corrupt is not None:
        (tmp_path / "sitecustomize.py").write_text(corrupt)
        env["PYTHONPATH"] = f"{tmp_path}:{ROOT}"
    runs = ["--world-sizes", "2", "--iters", "1", "--warmup", "0", "--timeout", "100"]
    proc = subprocess.run(
        [sys.executable, "-m", module, *runs, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    print(proc.stdout)
    return proc


@pytest.mark.timeout(120)
def test_bench_says_no_for_a_wrong_element_in_the_middle(tmp_path: Path) -> None:
    proc = _run_bench(tmp_path, "client.bench", CORRUPT_MIDDLE, "--sizes", "4K", "64K")
    rows = {line.split()[0] + " " + line.split()[1]: line for line in proc.stdout.splitlines()}
    assert "4 KiB" in rows and "64 KiB" in rows, proc.stdout + proc.stderr
    # Untouched, and corrupted in the middle only.
    assert rows["4 KiB"].rstrip().endswith(" yes"), f"expected yes: {rows['4 KiB']}"
    assert rows["64 KiB"].rstrip().endswith(" NO"), f"expected NO: {rows['64 KiB']}"
    assert proc.returncode == 1, proc.returncode


# After each blocking ferrogrpc all_reduce, one element in the middle of the
# result is off by one (any size).
CORRUPT_EVERY = CORRUPT_MIDDLE.replace(" and tensor.numel() >= 16384", "")


def _latency_bench(tmp_path: Path, corrupt: bool, *args: str) -> subprocess.CompletedProcess[str]:
    return _run_bench(
        tmp_path,
        "client.bench_latency",
        CORRUPT_EVERY if corrupt else None,
        "--sizes",
        "4",
        "64K",
        *args,
    )


@pytest.mark.timeout(120)
def test_latency_bench_reports_every_op_and_checks_the_results(tmp_path: Path) -> None:
    start = "own"  # the default ("gloo" differs from it in one argument)
    proc = _latency_bench(tmp_path, False, "--wire-iters", "1")
    sizes = {" ".join(line.split()[:2]) for line in proc.stdout.splitlines()}
    assert {"all_reduce 4", "all_reduce 64", "all_gather 4", "all_gather 64"} <= sizes, proc.stdout
    assert any(line.split()[0] == "barrier" for line in proc.stdout.splitlines() if line.strip())
    assert "wire_dtype=bfloat16" in proc.stdout, proc.stdout + proc.stderr
    assert "# results ok" in proc.stdout, proc.stdout + proc.stderr
    assert START_WORDS[start] in proc.stdout
    assert proc.returncode == 0, proc.returncode


@pytest.mark.timeout(120)
def test_latency_bench_says_wrong_for_a_wrong_result(tmp_path: Path) -> None:
    # The check runs untimed, after each call: it still sees every result.
    # (Run with the clock start, which the test above does not.)
    proc = _latency_bench(tmp_path, True, "--wire-iters", "0", "--start", "clock")
    assert START_WORDS["clock"] in proc.stdout, proc.stdout + proc.stderr
    assert "# results WRONG" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.returncode


@pytest.mark.timeout(120)
def test_elastic_bench_reports_the_kill_the_join_and_the_transfer() -> None:
    # An 8 MB request builds one 1024x1024 layer: 1,049,600 parameters, 12
    # bytes each with Adam's two moments, a third of them the model's part.
    proc = subprocess.run(
        [sys.executable, "-m", "client.bench", "--elastic", "--sizes", "8M", "--nproc", "2"],
        env={**clean_env(), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("   8 MiB"))
    cells = [float(x) for x in row.split()[2:]]
    step, kill, join, mb, s, _, model_mb, model_s, rate, bare, ratio = cells[:11]
    params = 1024 * 1024 + 1024
    assert mb == round(12 * params / 1e6, 1) and model_mb == round(4 * params / 1e6, 1), row
    assert 0 < model_s <= s and 0 < kill < 30 and 0 < join < 60 and step > 0, row
    assert rate > 0 and bare > 0 and ratio == pytest.approx(rate / bare, abs=0.01), row


@pytest.mark.timeout(120)
def test_elastic_fsdp_bench_reports_the_kill_the_join_and_the_joiners_shards() -> None:
    # ``bench --elastic --fsdp`` (issue 57, item 7), tiny: one 1024x1024
    # layer over 3 ranks, one killed, a replacement joins as rank 2 of 3.
    # Its shards, from its metrics: its own (the last, short of the
    # padding) and the copy of rank 1's it keeps, each with Adam's two
    # moments, float32.
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ferrogrpc.cli", "bench", "--elastic", "--fsdp"),
            *("--sizes", "8M", "--nproc", "3", "--timeout", "90"),
        ],
        env={**clean_env(), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("   8 MiB"))
    cells = [float(x) for x in row.split()[2:]]
    step, kill, join, mb, s, rate, bare, ratio = cells[:8]
    elements = 0
    for n in (1024 * 1024, 1024):
        shard = -(-n // 3)
        elements += (n - 2 * shard) + shard
    assert mb == round(12 * elements / 1e6, 1), row
    assert s > 0 and 0 < kill < 30 and 0 < join < 60 and step > 0, row
    # (Both printed rounded: to 0.1 MB and to the millisecond.)
    assert rate == pytest.approx(mb / s, rel=0.1), row
    assert bare > 0 and ratio == pytest.approx(rate / bare, abs=0.01), row
