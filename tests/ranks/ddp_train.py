"""A rank program for DDP: N-rank training on slices of a batch must equal
single-process training on the whole batch. Prints OK on success."""

from __future__ import annotations

import os
import sys

import common  # the script's folder is on sys.path
import torch
from torch import nn

import ferrogrpc as fg

BATCH = 12  # divisible by 2 and 3
STEPS = 5
TOL = 1e-5


class MLP(nn.Module):
    def __init__(self, hidden: int = 32, with_unused: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(7, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, 5)
        self.norm = nn.LayerNorm(hidden)
        self.unused = nn.Linear(3, 3) if with_unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.norm(self.l2(torch.relu(self.l1(x))))))


def make_model(seed: int = 0, **kw: object) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw).double()  # type: ignore[arg-type]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return common.batch(step, BATCH, 7, 5, 1000)


make_opt = common.make_opt


def reference(opt_name: str, steps: int = STEPS, **kw: object) -> MLP:
    model = make_model(**kw)
    opt = make_opt(opt_name, model.parameters())
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def reference_grads(step: int = 0, **kw: object) -> dict[str, torch.Tensor]:
    """Single-process gradients of the whole batch of ``step`` at the initial
    parameters: what the first sync must leave in every rank's ``.grad``."""
    model = make_model(**kw)
    x, y = batch(step)
    nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_first_grads(module: nn.Module, what: object, **kw: object) -> None:
    """The averaged gradients themselves, checked after the first sync. An
    equivalence check on Adam's results alone cannot see a wrong scale:
    Adam divides the gradient by its own running magnitude, so gradients x2
    move its parameters by ~4e-6, under the 1e-5 tolerance."""
    expected = reference_grads(**kw)
    for name, p in module.named_parameters():
        want = expected.get(name)
        if want is None:
            assert p.grad is None, (what, name, "has a gradient no rank produced")
            continue
        assert p.grad is not None, (what, name, "has no gradient after sync")
        diff = float((p.grad - want).abs().max())
        assert diff <= 1e-12, ("averaged gradient differs", what, name, diff)


def my_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = BATCH // world
    return t[rank * per : (rank + 1) * per]


max_diff = common.max_diff


def train_ddp(
    backend: fg.Backend, opt_name: str, bucket: int, overlap: bool, overlapped_sync: bool = False
) -> fg.DDP:
    model = make_model()
    ddp = fg.DDP(model, backend, bucket_size_bytes=bucket, overlap=overlap)
    opt = make_opt(opt_name, ddp.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        out = ddp(my_slice(x, backend.rank, backend.world_size))
        nn.functional.mse_loss(out, my_slice(y, backend.rank, backend.world_size)).backward()
        if overlapped_sync:
            ddp.overlapped_sync_gradients()
        else:
            ddp.sync_gradients()
        if step == 0:
            check_first_grads(ddp.module, (opt_name, bucket, overlap, overlapped_sync))
        opt.step()
    return ddp


def check_identical_across_ranks(backend: fg.Backend, module: nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    for other in backend.all_gather(flat):
        assert torch.equal(other, flat), "ranks disagree on parameters"


def main() -> None:
    backend = fg.init_backend()
    rank, world = backend.rank, backend.world_size
    refs = {name: reference(name) for name in ("sgd", "adam")}

    # 1. Equivalence over optimizers, bucket sizes and overlap.
    for opt_name in ("sgd", "adam"):
        for bucket in (1024, fg.DDP.__init__.__defaults__[0], 1 << 30):  # type: ignore[index]
            for overlap in (True, False):
                ddp = train_ddp(backend, opt_name, bucket, overlap)
                diff = max_diff(ddp.module, refs[opt_name])
                assert diff <= TOL, (opt_name, bucket, overlap, diff)
                check_identical_across_ranks(backend, ddp.module)
                ddp.into_inner()
    ddp = train_ddp(backend, "adam", 1024, True, overlapped_sync=True)
    assert max_diff(ddp.module, refs["adam"]) <= TOL
    layout = ddp.bucket_layout()
    assert len(layout) > 1 and layout[0][0] == "norm.bias", layout
    assert fg.DDP(make_model(), backend).bucket_layout() == [
        [n for n, _ in reversed(list(make_model().named_parameters()))]
    ]
    print(f"rank {rank}: equivalence ok, {len(layout)} buckets at 1 KiB", flush=True)

    # 2. no_sync: k micro-batches equal one step on their union.
    k = 3
    model = make_model()
    ddp = fg.DDP(model, backend, bucket_size_bytes=2048)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    xs, ys = zip(*(batch(50 + i) for i in range(k)), strict=True)
    opt.zero_grad()
    for i in range(k):
        ctx = ddp.no_sync() if i < k - 1 else torch.enable_grad()
        with ctx:
            out = ddp(my_slice(xs[i], rank, world))
            (nn.functional.mse_loss(out, my_slice(ys[i], rank, world)) / k).backward()
    ddp.sync_gradients()
    opt.step()
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    ref_opt.step()
    assert max_diff(ddp.module, ref) <= TOL, max_diff(ddp.module, ref)
    print(f"rank {rank}: no_sync ok", flush=True)

    # 3. Unused parameters: a globally unused one keeps .grad None (Adam then
    # matches single-process training exactly); one used on rank 0 only gets
    # the same mean on every rank. With SGD too, which a wrong scale of the
    # used parameters' gradients cannot hide from; and the gradients
    # themselves after the first sync.
    for opt_name in ("adam", "sgd"):
        ddp = fg.DDP(make_model(with_unused=True), backend, bucket_size_bytes=1024)
        opt = make_opt(opt_name, ddp.parameters())
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            out = ddp(my_slice(x, rank, world))
            nn.functional.mse_loss(out, my_slice(y, rank, world)).backward()
            ddp.sync_gradients()
            unused = ddp.module.unused
            assert unused is not None and unused.weight.grad is None
            if step == 0:
                check_first_grads(ddp.module, ("unused", opt_name), with_unused=True)
            opt.step()
        diff = max_diff(ddp.module, reference(opt_name, with_unused=True))
        assert diff <= TOL, ("unused", opt_name, diff)
    sometimes = make_model(with_unused=True)
    ddp = fg.DDP(sometimes, backend)
    x, y = batch(0)
    loss = nn.functional.mse_loss(ddp(my_slice(x, rank, world)), my_slice(y, rank, world))
    assert sometimes.unused is not None
    if rank == 0:
        loss = loss + sometimes.unused(torch.ones(1, 3, dtype=torch.float64)).sum()
    loss.backward()
    ddp.sync_gradients()
    g = sometimes.unused.weight.grad
    assert g is not None
    assert torch.allclose(g, torch.ones(3, 3, dtype=torch.float64) / world), g
    check_identical_across_ranks(backend, sometimes)
    print(f"rank {rank}: unused parameters ok", flush=True)

    # 4. broadcast_parameters: different inits become identical, in place,
    # and the optimizer built before still trains the model.
    model = make_model(seed=rank + 10)
    ddp = fg.DDP(model, backend)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    before = [id(p) for p in model.parameters()]
    ddp.broadcast_parameters(root=0)
    assert [id(p) for p in model.parameters()] == before
    check_identical_across_ranks(backend, model)
    ref = make_model(seed=10)
    assert max_diff(model, ref) == 0.0
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ddp(my_slice(x, rank, world)), my_slice(y, rank, world)).backward()
        ddp.sync_gradients()
        opt.step()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert max_diff(model, ref) <= TOL
    print(f"rank {rank}: broadcast_parameters ok", flush=True)

    # 5. Module behaviour.
    inner = make_model()
    ddp = fg.DDP(inner, backend)
    assert ddp.module is inner and ddp.backend is backend
    assert list(ddp.state_dict()) == list(inner.state_dict())
    ddp.load_state_dict(make_model(seed=3).state_dict())
    assert max_diff(inner, make_model(seed=3)) == 0.0
    ddp.eval()
    assert not inner.training
    ddp.train()
    assert inner.training
    assert [id(p) for p in ddp.parameters()] == [id(p) for p in inner.parameters()]
    assert ddp.into_inner() is inner
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in inner.parameters())

    # 6. Different models on different ranks: ConfigError on every rank.
    hidden = 32 if rank == 0 else 33
    try:
        fg.DDP(MLP(hidden=hidden).double(), backend)
    except fg.ConfigError as exc:
        text = str(exc)
        assert "l1.weight" in text and "(32, 7)" in text and "(33, 7)" in text, text
        assert "rank 0" in text and "rank 1" in text, text
        print(f"rank {rank}: fingerprint mismatch: {text}", flush=True)
    else:
        raise AssertionError("fingerprint mismatch was not detected")
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
