"""What the wrappers promise about state, checked in-process on two ranks
(each a Backend on its own thread): DDP's double-buffered gradient views
and its broadcast of parameters *and* buffers; FSDP's shard padding after a
full load, and a prefetched unit that did not run being freed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ferrogrpc as fg
from tests.helpers import backends, on_ranks

pytestmark = pytest.mark.timeout(120)


def _pair() -> list[fg.Backend]:
    return backends(2, shm=False)


def test_a_grad_kept_from_a_step_is_not_written_by_the_next_steps_all_reduce() -> None:
    # Each bucket has two buffers used in turn: the .grad views of one step
    # stay as they were through the next step's all-reduce (and go stale only
    # the step after, when their buffer is refilled).
    group = _pair()
    try:

        def run(rank: int) -> None:
            torch.manual_seed(0)
            model = nn.Linear(8, 4)
            ddp = fg.DDP(model, group[rank])
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
            kept: list[tuple[torch.Tensor, torch.Tensor]] = []
            for step in range(3):
                model.zero_grad(set_to_none=True)
                ddp(x * (step + 1)).sum().backward()
                ddp.sync_gradients()
                grad = model.weight.grad
                assert grad is not None
                kept.append((grad, grad.clone()))
                if step >= 1:
                    before, values = kept[step - 1]
                    assert torch.equal(before, values), f"step {step} wrote step {step - 1}'s .grad"

        on_ranks(run, 2)
    finally:
        for b in group:
            b.close()


def test_broadcast_parameters_copies_buffers_too() -> None:
    group = _pair()
    try:

        def run(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            torch.manual_seed(rank)  # different weights on each rank
            model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            bn = model[1]
            assert isinstance(bn, nn.BatchNorm1d)
            with torch.no_grad():
                bn.running_mean.fill_(float(rank + 1))
                bn.running_var.fill_(float(rank + 3))
            bn.num_batches_tracked.fill_(rank + 5)
            # The fingerprint checks names and shapes only: the values differ.
            ddp = fg.DDP(model, group[rank])
            ddp.broadcast_parameters(root=1)
            return [p.detach().clone() for p in model.parameters()], [
                b.clone() for b in model.buffers()
            ]

        (p0, b0), (p1, b1) = on_ranks(run, 2)
        for a, b in zip(p0, p1, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(b0, b1, strict=True):
            assert torch.equal(a, b), (a, b)
        assert b0[0].tolist() == [2.0] * 4 and b0[2].item() == 6  # rank 1's
    finally:
        for b in group:
            b.close()


def test_load_full_state_dict_zeroes_the_shard_padding() -> None:
    # 3 x 3 = 9 elements over 2 ranks: shards of 5, the last padded by one.
    group = _pair()
    try:

        def run(rank: int) -> list[torch.Tensor]:
            torch.manual_seed(0)
            model = nn.Linear(3, 3, bias=False)
            fsdp = fg.FSDP(model, group[rank])
            full = {"weight": torch.arange(9, dtype=torch.float32).reshape(3, 3)}
            with torch.no_grad():
                for shard in fsdp.parameters():
                    shard.fill_(math.nan)  # whatever was there, padding included
            fsdp.load_full_state_dict(full)
            state = fsdp.full_state_dict()
            assert torch.equal(state["weight"], full["weight"])
            return [s.detach().clone() for s in fsdp.parameters()]

        shards = on_ranks(run, 2)
        assert shards[0][0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert shards[1][0].tolist() == [5.0, 6.0, 7.0, 8.0, 0.0]  # padding: zero
    finally:
        for b in group:
            b.close()


class _Maybe(nn.Module):
    """Runs its layer unless ``skip`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else self.layer(x)


def test_a_prefetched_unit_whose_forward_did_not_run_is_freed() -> None:
    group = _pair()
    try:

        def run(rank: int) -> int:
            torch.manual_seed(0)
            maybe = _Maybe()
            model = nn.Sequential(nn.Linear(16, 16), maybe, nn.Linear(16, 16))
            fsdp = fg.FSDP(model, group[rank], units={nn.Linear})
            x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
            fsdp(x).sum().backward()  # the first forward records the order
            fsdp.sync_gradients()
            maybe.skip = True  # the middle unit is prefetched, and does not run
            out = fsdp(x)
            # What the middle unit's gather buffers hold once forward is over.
            runtime = fsdp._units
            assert runtime is not None
            (unit,) = [u for u in runtime.units if u.module is maybe.layer]
            held = sum(
                e.full.untyped_storage().nbytes() for e in unit.entries if e.full is not None
            )
            out.sum().backward()
            fsdp.sync_gradients()
            return held

        assert on_ranks(run, 2) == [0, 0]  # freed by the end of the forward
    finally:
        for b in group:
            b.close()
