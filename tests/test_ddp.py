"""DDP with real processes: N-rank training on slices equals single-process
training on the whole batch (SGD and Adam; 1 KiB, default and 1 GiB buckets;
overlap on and off), no_sync, unused parameters, broadcast_parameters, module
behaviour and the model fingerprint check. See tests/ranks/ddp_train.py.
And overlap itself: a bucket's all-reduce runs while backward still does."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

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


class _RecordingBackend:
    """Stands in for the Backend a DDP uses: passes every call through, and
    notes each all_reduce DDP issues (bucket k is the k-th: buckets start in
    order) in the rank's timeline, with the Work it returned."""

    def __init__(self, inner: Any, timeline: list[tuple[str, int]]) -> None:
        self._inner = inner
        self.timeline = timeline
        self.works: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def all_reduce(self, tensor: Any, op: Any = "sum", **kwargs: Any) -> Any:
        work = self._inner.all_reduce(tensor, op, **kwargs)
        self.timeline.append(("all_reduce", len(self.works)))
        self.works.append(work)
        return work


@pytest.mark.timeout(90)
def test_bucket_all_reduce_runs_while_backward_is_still_running() -> None:
    # Four Linear layers, one bucket each. Backward reaches them last to
    # first; a pre-hook on each layer notes when its backward begins. Bucket
    # k (layer 3-k) must be all-reduced as soon as its gradients are in:
    # before the next layer's backward begins. And when the first layer's
    # backward begins (backward's last work), bucket 0's all-reduce must
    # already have *finished* on the wire, with the other rank: the
    # collective really ran during backward, not only got queued.
    import torch
    from torch import nn

    import ferrogrpc as fg
    from tests.helpers import backends, on_ranks

    world = 2
    group = backends(world)
    torch.manual_seed(0)
    template = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8),
    )  # fmt: skip
    layers = [0, 2, 4, 6]  # indices of the Linear layers in the Sequential
    x, y = torch.randn(8, 16), torch.randn(8, 8)

    def run(rank: int) -> tuple[list[tuple[str, int]], list[str], dict[str, Any]]:
        model = copy.deepcopy(template)
        timeline: list[tuple[str, int]] = []
        recorder = _RecordingBackend(group[rank], timeline)
        ddp = fg.DDP(model, recorder, bucket_size_bytes=5 * 1024)  # type: ignore[arg-type]
        assert ddp.bucket_layout() == [[f"{i}.bias", f"{i}.weight"] for i in reversed(layers)]
        problems: list[str] = []

        def begins(index: int) -> Callable[..., None]:
            def hook(module: nn.Module, grad_output: Any) -> None:
                timeline.append(("backward", index))
                if index != layers[0]:
                    return
                if not recorder.works:
                    problems.append("bucket 0 had not been started when backward reached layer 0")
                    return
                deadline = time.monotonic() + 30
                while not recorder.works[0].is_completed() and time.monotonic() < deadline:
                    time.sleep(0.001)
                if not recorder.works[0].is_completed():
                    problems.append("bucket 0's all_reduce did not finish during backward")

            return hook

        for i in layers:
            model[i].register_full_backward_pre_hook(begins(i))
        half = slice(rank * 4, rank * 4 + 4)
        # An input that requires grad: layer 0's hook then sees a gradient
        # flow through it, like every other layer's.
        inputs = x[half].clone().requires_grad_()
        nn.functional.mse_loss(ddp(inputs), y[half]).backward()
        timeline.append(("backward done", -1))
        ddp.sync_gradients()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return timeline, problems, grads

    try:
        results = on_ranks(run, world)
    finally:
        for b in group:
            b.close()
    reference = copy.deepcopy(template)
    nn.functional.mse_loss(reference(x), y).backward()
    for rank, (timeline, problems, grads) in enumerate(results):
        assert not problems, (rank, problems, timeline)
        for bucket in range(len(layers) - 1):
            launched = timeline.index(("all_reduce", bucket))
            next_layer = timeline.index(("backward", layers[len(layers) - 2 - bucket]))
            assert launched < next_layer, (
                f"rank {rank}: bucket {bucket} started after the backward of layer "
                f"{layers[len(layers) - 2 - bucket]} began: {timeline}"
            )
        assert timeline.index(("all_reduce", 0)) < timeline.index(("backward done", -1))
        for name, p in reference.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5)
