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


@pytest.mark.timeout(60)
def test_buckets_follow_layers() -> None:
    # Reverse registration order, at most bucket_size_bytes each, a larger
    # parameter alone; and a layer's parameters (their gradients come from
    # one backward node) never hold back a bucket of an earlier-finished
    # layer.
    from torch import nn

    import ferrogrpc as fg
    from tests.helpers import free_port

    backend = fg.init_backend(0, 1, "127.0.0.1", free_port())
    try:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 64), nn.Linear(64, 8))
        # 4 KiB buckets: 2.weight (8 KiB) is larger than a bucket.
        layout = fg.DDP(model, backend, bucket_size_bytes=4096).bucket_layout()
        assert layout == [
            ["3.bias", "3.weight"],  # 2 KiB + 32 B
            ["2.bias"],  # 2.bias + 2.weight exceed a bucket: 2.bias alone, not with 3.*
            ["2.weight"],
            ["0.bias", "0.weight"],
        ], layout
        flat = [n for bucket in layout for n in bucket]
        assert flat == [n for n, _ in reversed(list(model.named_parameters()))]
        one = fg.DDP(model, backend, bucket_size_bytes=1 << 30).bucket_layout()
        assert one == [flat]
    finally:
        backend.close()
