"""Memory is part of performance: a rank's extra peak RSS during its first
all_reduces of a 256 MiB tensor, in fresh processes (so every buffer the
first call grows counts), stays within issue 2's bar of 128 MiB; and all of
a rank's threads allocate from one malloc arena, whose high-water marks
would otherwise add up (ferrogrpc/_malloc.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.helpers import run_ranks

MiB = 1 << 20
SIZE = 256 * MiB
BAR = 128 * MiB


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["grpc", "shared memory"])
@pytest.mark.parametrize("world", [4])  # (world 2 is the easier case)
def test_extra_peak_rss_of_a_256_mib_all_reduce_in_a_fresh_process(
    world: int, path: str, report: Callable[[str], None]
) -> None:
    shm = "0" if path == "grpc" else "1"
    outputs = run_ranks(
        "memory.py", world, str(SIZE), "2", timeout=220, env={"FERROGRPC_SHM": shm}, fresh=True
    )
    extras = []
    for rank, out in enumerate(outputs):
        assert f"OK rank {rank}/{world}" in out, out
        lines = out.splitlines()
        assert f"PATH {path}" in lines, out
        peak = int(next(x for x in lines if x.startswith("PEAK_EXTRA ")).split()[1])
        shared = int(next(x for x in lines if x.startswith("SHARED ")).split()[1])
        # The kernel counts every shared page in full in each process that
        # maps it; each rank's share is one world-th of the segments.
        extras.append(peak - shared + shared // world)
        assert "ARENAS 1" in lines, out
        if path == "grpc":
            assert shared == 0, out
        else:
            assert shared > 0, out
    report(
        f"extra peak RSS, first two 256 MiB all_reduces, world {world}, {path}: "
        + ", ".join(f"{e / MiB:.0f}" for e in extras)
        + " MiB per rank, shared segments divided among their ranks (bar 128)"
    )
    assert max(extras) <= BAR, extras
