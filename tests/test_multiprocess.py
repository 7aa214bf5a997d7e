"""Real processes: env:// rendezvous with plain variables, and under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import RANKS, ROOT, free_port, run_ranks


@pytest.mark.timeout(150)
def test_four_processes_with_plain_environment_variables() -> None:
    outputs = run_ranks("collectives.py", 4, timeout=140)
    for rank, out in enumerate(outputs):
        assert f"OK rank {rank}/4" in out, out


@pytest.mark.timeout(150)
def test_torchrun_two_ranks_init_backend_without_arguments() -> None:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(RANKS / "collectives.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "OK rank 0/2" in out and "OK rank 1/2" in out, out
