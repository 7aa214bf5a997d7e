"""Every script in scripts/ runs: each with tiny arguments, from a fresh
process, as a reader of BENCHMARKS.md would run it. (scripts/gpu_check.py
has its own CPU smoke test, tests/test_gpu_check.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, clean_env

# Each script, its tiny arguments, and a line its output must contain.
RUNS: dict[str, tuple[list[str], str]] = {
    "chunk_ab.py": (
        ["--world", "2", "--chunks-mib", "1", "2", "--sizes-mib", "1", "--iters", "1"],
        "MiB",
    ),
    "elastic_soak.py": (["--nproc", "2", "--burners", "0", "--seconds", "3"], "OK: nobody removed"),
    "fsdp_elastic_overhead.py": (
        [
            *("--params", "2e5", "--nproc", "2", "--repeats", "1", "--steps", "3"),
            *("--warmup", "1", "--heartbeat", "2"),
        ],
        "elastic / fixed step time",
    ),
    "fsdp_elastic_recovery.py": (
        [
            *("--params", "200k", "--nproc", "3", "--repeats", "1", "--steps", "40"),
            *("--warmup", "2", "--pace", "0.25", "--shm", "--timeout", "60", "--heartbeat", "2"),
        ],
        "joiner's shards arriving / bare stream",
    ),
    "fsdp_redundancy_ab.py": (
        [
            *("--params", "2e5", "--nproc", "2", "--repeats", "1", "--steps", "3"),
            *("--warmup", "1", "--modes", "grad", "stream"),
        ],
        "stream: ",
    ),
    "gen_proto.py": (["--check"], ""),
    "grpc_ceiling.py": (
        ["--world-size", "2", "--mib", "2", "--chunk-kib", "256", "--start-delay", "3"],
        "GB/s",
    ),
    "grpc_latency_floor.py": (["--mode", "aio", "--exchanges", "20"], "us"),
    "grpc_stream_setup.py": (["--rounds", "5", "--repeats", "1"], "one long-lived stream"),
    "loopback_ceiling.py": (["--mib", "4", "--iters", "1"], "GB/s"),
    "mem_ceiling.py": (["--mib", "4", "--iters", "2"], "GB/s"),
    "observe_overhead.py": (
        ["--rounds", "2", "--steps", "1", "--warmup", "1", "--width", "64", "--io", "32"],
        "trace vs off",
    ),
    "own_cost.py": (["--world-size", "2", "--mib", "1", "--iters", "1"], "ms"),
    "restart_anchor.py": (
        [
            "--params",
            "1M",
            "--nproc",
            "2",
            "--repeats",
            "1",
            "--steps",
            "5",
            "--ckpt-step",
            "1",
            "--kill-step",
            "3",
        ],
        "kill -> first step after restart",
    ),
    "small_cpu.py": (["--world", "2", "--calls", "20"], "us"),
}
# (elastic_chaos.py's engine runs in tests/test_restart.py.)
OWN_TEST = {"gpu_check.py", "elastic_chaos.py"}


def test_every_script_has_a_smoke_run() -> None:
    scripts = {p.name for p in (ROOT / "scripts").glob("*.py")}
    assert scripts == set(RUNS) | OWN_TEST, scripts ^ (set(RUNS) | OWN_TEST)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("script", sorted(RUNS))
def test_script_runs_with_tiny_arguments(script: str) -> None:
    args, expect = RUNS[script]
    proc = subprocess.run(
        [sys.executable, f"scripts/{script}", *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    assert expect in proc.stdout, out
