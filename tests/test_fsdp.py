"""FSDP with real processes: sharded training equals single-process training
(SGD and Adam, sizes the world size does not divide), resident parameter
memory is 1/world_size plus padding, update_shards and checkpoints
round-trip. See tests/ranks/fsdp_train.py."""

from __future__ import annotations

import pytest

from tests.helpers import run_ranks


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_single_process_training(world: int) -> None:
    outputs = run_ranks("fsdp_train.py", world, timeout=160)
    for rank, out in enumerate(outputs):
        assert f"OK rank {rank}/{world}" in out, out
        assert "sgd equivalence ok" in out and "adam equivalence ok" in out
