"""Real processes: env:// rendezvous with plain variables, and under torchrun."""

from __future__ import annotations

import pytest

from tests.helpers import RANKS, run_ranks, run_torchrun


@pytest.mark.timeout(150)
def test_four_processes_with_plain_environment_variables() -> None:
    outputs = run_ranks("collectives.py", 4, timeout=140)
    for rank, out in enumerate(outputs):
        assert f"OK rank {rank}/4" in out, out


@pytest.mark.timeout(150)
def test_torchrun_two_ranks_init_backend_without_arguments() -> None:
    proc = run_torchrun(2, str(RANKS / "collectives.py"), timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "OK rank 0/2" in out and "OK rank 1/2" in out, out
