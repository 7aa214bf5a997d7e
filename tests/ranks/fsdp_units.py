"""A rank program for FSDP units (see tests/test_fsdp_units.py). Modes:

- ``train``: sharded training with units equals single-process training
  (float64, 1e-6): parameters after every step, and the averaged gradients
  of every step, for SGD and Adam, units by class and by predicate (nested,
  with an in-place op on a unit's output), ``reshard_after_forward=False``,
  activation checkpointing, tied weights, gradient accumulation, an eval
  forward between steps; parameters are freed after each unit's
  forward and after the step; update_shards, the full and sharded state
  dicts round-trip, and bad arguments are refused.
- ``overlap``: the order in which gathers, reduce-scatters and the units'
  forward and backward happen, seen through a recording backend and the
  model's own hooks: one-unit-ahead prefetch in forward and backward, and
  every reduce-scatter issued before backward returns.
- ``fail``: a collective fails in the middle of a backward pass (rank 1
  issues a barrier from a hook, which the other rank's next collective does
  not match): every shard ``.grad`` is left exactly as it was.
- ``memory none|linear``: peak RSS over the RSS before the model was built,
  for one training step of a 100 MB model (kernel high-water mark).
- ``save DIR`` / ``load DIR``: a sharded checkpoint saved at one world size
  is refused at another.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common  # the script's folder is on sys.path
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import ferrogrpc as fg

BATCH = 12
STEPS = 4
TOL = 1e-6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)  # 35 + 5 elements: not divisible by 2 or 3
        self.b = nn.Linear(5, 11)
        self.c = nn.Linear(11, 3)
        self.scale = nn.Parameter(torch.ones(1))  # the root's; smaller than the world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x))))) * self.scale


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.inner(x)) + x)


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.block = Block()
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place on a unit's output, after FSDP hooked it.
        return self.out(torch.relu_(self.block(self.inp(x))))


class Checkpointed(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Unit b is recomputed during backward (activation checkpointing),
        # to the end of its forward: its post-forward hook runs in backward.
        with set_checkpoint_early_stop(False):
            h = checkpoint(self.b, torch.relu(self.a(x)), use_reentrant=False)
        return self.c(torch.tanh(h)) * self.scale


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return Net().double()


def make_deep() -> nn.Module:
    torch.manual_seed(0)
    return Deep().double()


def make_checkpointed() -> nn.Module:
    torch.manual_seed(0)
    return Checkpointed().double()


def make_tied() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))
    model[2].weight = model[0].weight  # one Parameter in two units
    return model.double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return common.batch(step, BATCH, 7, 3, 3000)


def reference(
    make: Callable[[], nn.Module], opt_name: str
) -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    """Single-process training on the whole batch, and each step's gradients."""
    model = make()
    opt = common.make_opt(opt_name, model.parameters())
    grads = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return model, grads


def shard_of(full: torch.Tensor, shard_numel: int, rank: int) -> torch.Tensor:
    flat = torch.zeros(shard_numel * (rank + 1) + full.numel(), dtype=full.dtype)
    flat[: full.numel()] = full.reshape(-1)
    return flat[rank * shard_numel : (rank + 1) * shard_numel]


def unit_params(fsdp: fg.FSDP) -> list[nn.Parameter]:
    names = {n for unit, params in fsdp.unit_layout()[1:] for n in params}
    return [p for n, p in fsdp.module.named_parameters() if n in names]


def train(
    backend: Any,
    make: Callable[[], nn.Module],
    opt_name: str,
    *,
    units: Any,
    reshard: bool = True,
    accumulate: bool = False,
) -> fg.FSDP:
    rank, world = backend.rank, backend.world_size
    per = BATCH // world
    ref, ref_grads = reference(make, opt_name)
    model = make()
    fsdp = fg.FSDP(model, backend, units=units, reshard_after_forward=reshard)
    opt = common.make_opt(opt_name, fsdp.parameters())
    label = f"{opt_name} units={units!r} reshard={reshard} accumulate={accumulate}"
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad()
        if not accumulate:
            out = fsdp(x)
            held = [p.untyped_storage().nbytes() for p in unit_params(fsdp)]
            assert all(n == 0 for n in held) if reshard else all(n > 0 for n in held), held
            nn.functional.mse_loss(out, y).backward()
        elif step % 2 == 0:  # two micro-batches, one backward each
            for half in (slice(0, per // 2), slice(per // 2, per)):
                nn.functional.mse_loss(fsdp(x[half]), y[half]).div(2).backward()
        else:  # two forwards, then one backward through both
            rows = (slice(0, 1), slice(1, 2))
            losses = [nn.functional.mse_loss(fsdp(x[h]), y[h]).div(2) for h in rows]
            (losses[0] + losses[1]).backward()
        fsdp.sync_gradients()
        if not accumulate:
            named = dict(fsdp.named_parameters())
            for name, full in ref_grads[step].items():
                shard = named[name]
                assert shard.grad is not None, (label, name)
                diff = float((shard.grad - shard_of(full, shard.numel(), rank)).abs().max())
                assert diff <= TOL, (label, step, name, diff)
        opt.step()
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        assert all(p.grad is None for p in model.parameters())
        with torch.no_grad():  # an eval forward between steps changes nothing
            fsdp(x)
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    if accumulate:
        return fsdp
    full = fsdp.full_state_dict()
    assert list(full) == list(ref.state_dict()), (list(full), list(ref.state_dict()))
    for key, value in ref.state_dict().items():
        diff = float((full[key] - value).abs().max())
        assert diff <= TOL, (label, key, diff)
    print(f"rank {rank}: {label} equivalence ok", flush=True)
    return fsdp


def accumulation_reference(opt_name: str, world: int) -> nn.Module:
    """What ``train(accumulate=True)`` computes, in one process: the mean
    over ranks of each rank's micro-batch gradients."""
    model = make_net()
    opt = common.make_opt(opt_name, model.parameters())
    per = BATCH // world
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        total = torch.zeros(())
        for r in range(world):
            xs, ys = x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]
            if step % 2 == 0:
                parts = [(xs[: per // 2], ys[: per // 2]), (xs[per // 2 :], ys[per // 2 :])]
            else:
                parts = [(xs[0:1], ys[0:1]), (xs[1:2], ys[1:2])]
            for xp, yp in parts:
                total = total + nn.functional.mse_loss(model(xp), yp) / 2 / world
        total.backward()
        opt.step()
    return model


def check_state_dicts(backend: Any, fsdp: fg.FSDP) -> None:
    rank, world = backend.rank, backend.world_size
    before = fsdp.full_state_dict()
    sharded = fsdp.sharded_state_dict()
    meta = sharded["_ferrogrpc_fsdp_shard"]
    assert meta["rank"] == rank and meta["world_size"] == world, meta
    buf = io.BytesIO()
    torch.save(sharded, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    # Only this rank's shards were saved: about 1/world of the model.
    saved = sum(v.numel() for k, v in loaded.items() if isinstance(v, torch.Tensor))
    assert saved <= sum(v.numel() for v in before.values()) / world + world * len(before)
    torch.manual_seed(123)
    other = fg.FSDP(Net().double(), backend, units={nn.Linear})
    other.load_sharded_state_dict(loaded)
    after = other.full_state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # Refused, naming both sides, and nothing is changed.
    flat = other.flat_shards().clone()
    for field, value, words in (
        ("world_size", world + 1, [str(world + 1), str(world)]),
        ("rank", (rank + 1) % world, [f"rank {(rank + 1) % world}", f"rank {rank}"]),
    ):
        bad = dict(loaded)
        bad["_ferrogrpc_fsdp_shard"] = dict(meta, **{field: value})
        try:
            other.load_sharded_state_dict(bad)
        except fg.ConfigError as exc:
            assert all(w in str(exc) for w in words), exc
        else:
            raise AssertionError(f"a checkpoint with another {field} was accepted")
    try:
        other.load_sharded_state_dict(before)  # a full one
    except fg.ConfigError as exc:
        assert "load_full_state_dict" in str(exc), exc
    else:
        raise AssertionError("a full state dict was loaded as a sharded one")
    assert torch.equal(other.flat_shards(), flat)
    # update_shards, and the full state dict round trip.
    other.update_shards(flat * 2)
    assert torch.equal(other.flat_shards(), flat * 2)
    other.load_full_state_dict(before)
    assert torch.equal(other.flat_shards(), flat)
    inner = other.into_inner()
    for key, value in before.items():
        assert torch.equal(inner.state_dict()[key], value), key
    print(f"rank {rank}: state dicts ok", flush=True)


def mode_train(backend: Any) -> None:
    for bad in (nn.Linear, {nn.Linear, int}, 3):
        try:
            fg.FSDP(make_net(), backend, units=bad)
        except fg.ConfigError:
            pass
        else:
            raise AssertionError(f"units={bad!r} accepted")
    # Ranks that choose different units are refused on every rank.
    try:
        fg.FSDP(make_net(), backend, units={nn.Linear} if backend.rank == 0 else None)
    except fg.ConfigError as exc:
        assert "unit <root>: scale" in str(exc), exc
    else:
        raise AssertionError("ranks with different units were accepted")
    fsdp = train(backend, make_net, "sgd", units={nn.Linear})
    assert fsdp.unit_layout() == [
        ("<root>", ["scale"]),
        ("a", ["a.weight", "a.bias"]),
        ("b", ["b.weight", "b.bias"]),
        ("c", ["c.weight", "c.bias"]),
    ], fsdp.unit_layout()
    check_state_dicts(backend, fsdp)
    train(backend, make_net, "adam", units={nn.Linear})
    train(backend, make_net, "adam", units={nn.Linear}, reshard=False)

    def nested(name: str, module: nn.Module) -> bool:
        return isinstance(module, Block) or name == "block.inner"

    deep = train(backend, make_deep, "adam", units=nested)
    assert [u for u, _ in deep.unit_layout()] == ["<root>", "block", "block.inner"]
    assert deep.unit_layout()[1][1] == ["block.norm.weight", "block.norm.bias"]
    train(backend, make_checkpointed, "sgd", units={nn.Linear})
    tied = train(backend, make_tied, "sgd", units={nn.Linear})
    # The shared weight belongs to the common ancestor: the root.
    assert tied.unit_layout()[0] == ("<root>", ["0.weight"]), tied.unit_layout()
    assert "2.weight" in tied.full_state_dict()
    acc = train(backend, make_net, "adam", units={nn.Linear}, accumulate=True)
    expected = accumulation_reference("adam", backend.world_size).state_dict()
    full = acc.full_state_dict()
    for key, value in expected.items():
        diff = float((full[key] - value).abs().max())
        assert diff <= TOL, ("accumulate", key, diff)
    print(f"rank {backend.rank}: accumulation equivalence ok", flush=True)


class Recording:
    """A backend that records which collectives FSDP issues, in order."""

    def __init__(self, backend: Any, events: list[tuple[str, Any]]) -> None:
        self._backend = backend
        self.events = events
        self.works: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def all_gather_into_tensor(self, out: Any, t: Any, *, async_op: bool = False) -> Any:
        self.events.append(("gather", out.numel()))
        return self._backend.all_gather_into_tensor(out, t, async_op=async_op)

    def reduce_scatter_tensor(self, out: Any, t: Any, op: Any = "sum", **kw: Any) -> Any:
        self.events.append(("rs", t.numel()))
        work = self._backend.reduce_scatter_tensor(out, t, op, **kw)
        self.works.append(work)
        return work


def make_chain() -> nn.Sequential:
    torch.manual_seed(0)
    sizes = [(3, 4), (4, 5), (5, 7), (7, 2)]  # padded weight sizes at world 2: 12, 20, 36, 14
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(sizes):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(sizes) - 1 else [])
    return nn.Sequential(*layers).double()


def watch(chain: nn.Sequential, events: list[tuple[str, Any]], freed: list[bool]) -> None:
    """The model's own hooks (registered after FSDP's, so they run after
    them): a unit's forward starting and ending, and backward reaching it."""
    for k, layer in enumerate(m for m in chain if isinstance(m, nn.Linear)):

        def pre(_m: nn.Module, _a: Any, k: int = k) -> None:
            events.append(("pre", k))

        def post(m: nn.Module, _a: Any, out: torch.Tensor, k: int = k) -> None:
            events.append(("post", k))
            freed.append(m.weight.untyped_storage().nbytes() == 0)
            out.register_hook(lambda _g, k=k: events.append(("bwd", k)))  # type: ignore[misc]

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)


def mode_overlap(backend: Any) -> None:
    assert backend.world_size == 2
    events: list[tuple[str, Any]] = []
    recording = Recording(backend, events)
    chain = make_chain()
    fsdp = fg.FSDP(chain, recording, units={nn.Linear})  # type: ignore[arg-type]
    freed: list[bool] = []
    watch(chain, events, freed)
    weight = {12: 0, 20: 1, 36: 2, 14: 3}
    for step in range(2):
        events.clear()
        x, y = common.batch(step, 4, 3, 2, 4000)
        loss = nn.functional.mse_loss(fsdp(x), y)
        events.append(("backward", "start"))
        loss.backward()
        events.append(("backward", "returned"))
        fsdp.sync_gradients()
    at = {e: i for i, e in reversed(list(enumerate(events)))}  # first occurrence

    def gathers(k: int) -> list[int]:
        return [i for i, (kind, n) in enumerate(events) if kind == "gather" and weight.get(n) == k]

    start = at[("backward", "start")]
    for k in range(4):
        fwd, bwd = gathers(k)  # gathered twice: for forward, and again for backward
        assert fwd < start < bwd, (k, events)
    # Forward: unit k+1's gather is issued after unit k-1 ended and before
    # unit k ends (while k computes), not all at once and not on demand.
    for k in range(3):
        after = at[("post", k - 1)] if k else 0
        assert after < gathers(k + 1)[0] < at[("post", k)], (k, events)
    assert all(freed), "a unit's parameters were not freed right after its forward"
    # Backward: unit k-1's gather is issued before backward reaches unit k,
    # after it reached unit k+1.
    for k in range(3, 0, -1):
        before = at[("bwd", k + 1)] if k < 3 else start
        assert before < gathers(k - 1)[1] < at[("bwd", k)], (k, events)
    # Every reduce-scatter is issued during backward, in reverse forward
    # order; the last unit's before backward even reaches the first unit.
    rs = [(i, weight[n]) for i, (kind, n) in enumerate(events) if kind == "rs" and n in weight]
    assert [k for _, k in rs] == [3, 2, 1, 0], events
    assert all(start < i < at[("backward", "returned")] for i, _ in rs), events
    assert rs[0][0] < at[("bwd", 0)], events
    print(f"rank {backend.rank}: overlap order ok: {events}", flush=True)


def mode_fail(backend: Any) -> None:
    assert backend.world_size == 2
    rank = backend.rank
    recording = Recording(backend, [])
    chain = make_chain()
    fsdp = fg.FSDP(chain, recording, units={nn.Linear})  # type: ignore[arg-type]
    x, y = common.batch(0, 4, 3, 2, 5000)
    nn.functional.mse_loss(fsdp(x), y).backward()
    fsdp.sync_gradients()
    shards = [p for _, p in fsdp.named_parameters()]
    grads = [p.grad for p in shards]
    values = [g.clone() for g in grads if g is not None]
    assert len(values) == len(shards)
    first = len(recording.works)
    if rank == 1:
        # Mid-backward, rank 1 issues a collective that rank 0 does not.
        def stray(_g: torch.Tensor) -> None:
            backend.barrier()

        def arm(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
            out.register_hook(stray)

        chain[2].register_forward_hook(arm)
    x, y = common.batch(1, 4, 3, 2, 5000)  # other data: other gradients
    failure: BaseException | None = None
    try:
        nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.sync_gradients()
    except fg.FerroGrpcError as exc:
        failure = exc
    assert failure is not None, "the step succeeded"
    try:
        fsdp.sync_gradients()
    except fg.FerroGrpcError:
        pass
    else:
        raise AssertionError("a sync after the failure succeeded")
    for p, g, v in zip(shards, grads, values, strict=True):
        assert p.grad is g and torch.equal(p.grad, v), "a .grad changed"
    done = [w for w in recording.works[first:] if w.is_completed() and w.exception() is None]
    if rank == 0:
        # Some units' reduce-scatters had succeeded before the failure.
        assert done, "no reduce-scatter succeeded before the failure"
    print(
        f"rank {rank}: failure left .grad untouched ({len(done)} reduce-scatters had "
        f"succeeded): {failure!r}",
        flush=True,
    )


def mode_memory(backend: Any, which: str) -> None:
    units = None if which == "none" else {nn.Linear}
    # The engine's buffers and shared-memory slots are in use before, as in
    # any job past its first step: only what FSDP holds counts.
    world = backend.world_size
    big = torch.ones(world << 22)
    backend.all_reduce(big)
    backend.all_gather_into_tensor(big, torch.ones(1 << 22))
    backend.reduce_scatter_tensor(torch.empty(1 << 22), big)
    del big
    keep: list[Any] = []

    def step() -> None:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(2048, 2048), nn.ReLU()]
        model = nn.Sequential(*layers)  # 100.7 MB of float32 parameters
        fsdp = fg.FSDP(model, backend, units=units)
        opt = torch.optim.SGD(fsdp.parameters(), lr=1e-3)
        x = torch.randn(8, 2048)
        opt.zero_grad()
        fsdp(x).square().mean().backward()
        fsdp.sync_gradients()
        opt.step()
        keep.append((fsdp, opt))

    before = fg.testing.rss()
    peak = fg.testing.peak_rss(step)
    print(f"PEAK {peak - before}", flush=True)


def mode_save(backend: Any, folder: Path) -> None:
    fsdp = fg.FSDP(make_net(), backend, units={nn.Linear})
    torch.save(fsdp.sharded_state_dict(), folder / f"rank{backend.rank}.pt")


def mode_load(backend: Any, folder: Path) -> None:
    saved = torch.load(folder / f"rank{min(backend.rank, 1)}.pt", weights_only=True)
    fsdp = fg.FSDP(make_net(), backend, units={nn.Linear})
    try:
        fsdp.load_sharded_state_dict(saved)
    except fg.ConfigError as exc:
        assert "world size 2" in str(exc) and f"world size {backend.world_size}" in str(exc)
        print(f"refused: {exc}", flush=True)
    else:
        raise AssertionError("a checkpoint of another world size was loaded")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "train"
    backend = fg.init_backend()
    if mode == "train":
        mode_train(backend)
    elif mode == "overlap":
        mode_overlap(backend)
    elif mode == "fail":
        mode_fail(backend)
    elif mode == "memory":
        mode_memory(backend, sys.argv[2])
    elif mode == "save":
        mode_save(backend, Path(sys.argv[2]))
    elif mode == "load":
        mode_load(backend, Path(sys.argv[2]))
    backend.close()
    print(f"OK rank {backend.rank}/{backend.world_size}", flush=True)


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
