"""A rank program for FSDP: N-rank sharded training on slices of a batch must
equal single-process training on the whole batch. Prints OK on success."""

from __future__ import annotations

import os
import sys

import common  # the script's folder is on sys.path
import torch
from torch import nn

import ferrogrpc as fg

BATCH = 12
STEPS = 5
TOL = 1e-5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)  # 35 + 5 elements: not divisible by 2 or 3
        self.b = nn.Linear(5, 11)
        self.c = nn.Linear(11, 3)
        self.scale = nn.Parameter(torch.ones(1))  # 1 element: smaller than world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x))))) * self.scale


def make_model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return common.batch(step, BATCH, 7, 3, 2000)


make_opt = common.make_opt


def reference(opt_name: str) -> Net:
    model = make_model()
    opt = make_opt(opt_name, model.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def expected_shard_grads(rank: int, world: int) -> list[torch.Tensor]:
    """This rank's shard of every single-process gradient of the whole first
    batch, at the initial parameters: each parameter flattened, padded with
    zeros to a multiple of the world size, this rank's 1/world of it (the
    sharding API.md fixes), in parameter order."""
    model = make_model()
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    shards = []
    for p in model.parameters():
        assert p.grad is not None
        per = -(-p.numel() // world)
        padded = torch.zeros(per * world, dtype=p.dtype)
        padded[: p.numel()] = p.grad.reshape(-1)
        shards.append(padded[rank * per : (rank + 1) * per])
    return shards


def check_first_grads(fsdp: fg.FSDP, opt_name: str, rank: int, world: int) -> None:
    """The averaged gradients themselves, after the first sync: Adam's
    results alone cannot show a wrong scale (gradients x2 move them by
    ~2e-7, under the 1e-5 tolerance)."""
    shards = list(fsdp.parameters())
    expected = expected_shard_grads(rank, world)
    assert len(shards) == len(expected), (len(shards), len(expected))
    for i, (shard, want) in enumerate(zip(shards, expected, strict=True)):
        assert shard.grad is not None, (opt_name, i, "no gradient after sync")
        diff = float((shard.grad - want).abs().max())
        assert diff <= 1e-12, ("averaged gradient differs", opt_name, i, diff)


def main() -> None:
    backend = fg.init_backend()
    rank, world = backend.rank, backend.world_size
    per = BATCH // world
    # (Resident memory is measured by the kernel: tests/ranks/fsdp_memory.py.)
    for opt_name in ("sgd", "adam"):
        model = make_model()
        fsdp = fg.FSDP(model, backend)
        opt = make_opt(opt_name, fsdp.parameters())
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            out = fsdp(x[rank * per : (rank + 1) * per])
            nn.functional.mse_loss(out, y[rank * per : (rank + 1) * per]).backward()
            fsdp.sync_gradients()
            if step == 0:
                check_first_grads(fsdp, opt_name, rank, world)
            opt.step()
            assert all(p.grad is None for p in model.parameters())
        ref = reference(opt_name)
        full = fsdp.full_state_dict()
        assert list(full) == list(ref.state_dict()), (list(full), list(ref.state_dict()))
        for key, value in ref.state_dict().items():
            diff = float((full[key] - value).abs().max())
            assert diff <= TOL, (opt_name, key, diff)
        print(f"rank {rank}: {opt_name} equivalence ok", flush=True)

    # update_shards round-trips, and rejects a wrong length.
    flat = fsdp.flat_shards()
    assert flat.numel() == sum(fsdp.shard_numels())
    fsdp.update_shards(flat * 2)
    assert torch.equal(fsdp.flat_shards(), flat * 2)
    fsdp.update_shards(flat)
    try:
        fsdp.update_shards(torch.zeros(flat.numel() + 1, dtype=flat.dtype))
    except ValueError as exc:
        assert str(flat.numel()) in str(exc) and str(flat.numel() + 1) in str(exc), exc
    else:
        raise AssertionError("wrong length accepted")
    # load_full_state_dict then full_state_dict round-trips.
    other = make_model().state_dict()
    fsdp.load_full_state_dict(other)
    again = fsdp.full_state_dict()
    for key, value in other.items():
        assert torch.equal(again[key], value), key
    inner = fsdp.into_inner()
    assert inner is model
    for key, value in other.items():
        assert torch.equal(inner.state_dict()[key], value), key
    assert fsdp.module is model and fsdp.backend is backend

    # Tied parameters: every alias key gets the full tensor.
    torch.manual_seed(1)
    tied = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    tied[2].weight = tied[0].weight
    expected = {k: v.clone() for k, v in tied.state_dict().items()}
    tied_sd = fg.FSDP(tied, backend).full_state_dict()
    assert list(tied_sd) == list(expected)
    for key, value in expected.items():
        assert torch.equal(tied_sd[key], value), key
    backend.close()
    print(f"OK rank {rank}/{world}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:
        print(f"FAILED: {exc!r}", flush=True)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    # Closed already: end now, without torch's exit-time destructors (0.7 s
    # of CPU a process, which the suite would pay hundreds of times).
    os._exit(0)
