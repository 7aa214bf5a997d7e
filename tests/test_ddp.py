"""DDP with real processes: N-rank training on slices equals single-process
training on the whole batch (SGD and Adam; 1 KiB, default and 1 GiB buckets;
overlap on and off), no_sync, unused parameters, broadcast_parameters, module
behaviour and the model fingerprint check. See tests/ranks/ddp_train.py."""

from __future__ import annotations

import pytest

from tests.helpers import run_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_single_process_training(world: int) -> None:
    outputs = run_ranks("ddp_train.py", world, timeout=220)
    for rank, out in enumerate(outputs):
        assert f"OK rank {rank}/{world}" in out, out
        assert "equivalence ok" in out and "no_sync ok" in out and "unused parameters ok" in out
        assert "broadcast_parameters ok" in out and "fingerprint mismatch" in out
