"""Real processes: env:// rendezvous with plain variables."""

from __future__ import annotations

import pytest

from tests.helpers import run_ranks


@pytest.mark.timeout(150)
def test_four_processes_with_plain_environment_variables() -> None:
    outputs = run_ranks("collectives.py", 4, timeout=140)
    for rank, out in enumerate(outputs):
        assert f"OK rank {rank}/4" in out, out


# init_backend() without arguments under torchrun: client.train does exactly
# that in test_launch.py's test_client_train_under_torchrun.
