"""scripts/gpu_check.py must not rot between GPU runs: its CPU mode runs the
same checks (collectives, DDP and FSDP equivalence, the bandwidth table,
DDP step time with overlap on and off)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.timeout(120)
def test_gpu_check_script_cpu_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--timeout", "100"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "collectives:" in proc.stdout and "0 failures" in proc.stdout, proc.stdout
    assert "all checks passed" in proc.stdout.splitlines()[-1], proc.stdout
    assert "DDP overlap=on" in proc.stdout and "overlap on / off:" in proc.stdout, proc.stdout
    assert "FSDP-UNITS on cpu" in proc.stdout, proc.stdout
