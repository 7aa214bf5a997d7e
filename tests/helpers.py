"""Shared test helpers: float64 references and launching real rank processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ferrogrpc import launch

ROOT = Path(__file__).resolve().parent.parent
RANKS = Path(__file__).resolve().parent / "ranks"


free_port = launch.free_port


def reference_sum(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The independent reference: the inputs summed in float64."""
    return torch.stack([t.to(torch.float64) for t in inputs]).sum(0)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return {"atol": 1e-2, "rtol": 1e-2}
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return (
        {"atol": 0.0, "rtol": 0.0}
        if not dtype.is_floating_point
        else {"atol": 1e-12, "rtol": 1e-12}
    )


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return launch.rank_env(
        rank,
        world,
        port,
        extra={
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **extra,
        },
    )


def run_ranks(
    script: str,
    world: int,
    *args: str,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run ``tests/ranks/<script>`` as ``world`` processes with torch's env://
    variables; fail (killing all) if any exits non-zero or the group overruns
    ``timeout``. Returns each rank's stdout."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANKS / script), *args],
            env=rank_env(rank, world, port, **(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            remaining = max(1.0, deadline - time.monotonic())
            try:
                out, _ = proc.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"rank {rank} of {script} did not finish in {timeout}s"
                ) from None
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {script} exited {proc.returncode}:\n{out}"
    return outputs


def clean_env() -> dict[str, str]:
    """This environment without rendezvous variables, with the repo importable."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERROGRPC_COORDINATOR"):
        env.pop(key, None)
    return env


def run_torchrun(
    nproc: int, *program: str, timeout: float = 110
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc-per-node N <program>`` on a
    free port, output captured."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            *program,
        ],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
