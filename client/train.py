"""A rank's training program: an MLP on synthetic regression data, with
ferrogrpc DDP or FSDP.

    python -m client.train --mode ddp --steps 20

Rendezvous comes from the environment, so the same command works with a
coordinator (``FERROGRPC_COORDINATOR=host:port``), under torchrun, under
``ferrogrpc launch``, and with explicit RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT. Every step prints one JSON line with the loss and a checksum of
the parameters, which must be identical on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping
from typing import NoReturn

import torch
from torch import nn

import ferrogrpc as fg

IN_FEATURES = 16
OUT_FEATURES = 4


def emit(record: Mapping[str, object]) -> None:
    """One JSON line, in a single write so that ranks sharing a stdout do not
    interleave within a line."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def build_model(hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, OUT_FEATURES),
    ).double()


def global_batch(step: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of a step, the same on every rank: y = sin(x W) + noise."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    w = torch.randn(
        IN_FEATURES,
        OUT_FEATURES,
        generator=torch.Generator().manual_seed(seed),
        dtype=torch.float64,
    )
    w /= IN_FEATURES**0.5  # keep x @ w ~ N(0, 1), where sin is learnable
    x = torch.randn(batch, IN_FEATURES, generator=gen, dtype=torch.float64)
    y = torch.sin(x @ w) + 0.05 * torch.randn(
        batch, OUT_FEATURES, generator=gen, dtype=torch.float64
    )
    return x, y


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if t.shape[0] % world:
        raise fg.ConfigError(f"batch {t.shape[0]} is not divisible by world_size {world}")
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def make_optimizer(params: object, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)  # type: ignore[arg-type]


def checksum(wrapper: nn.Module, backend: fg.Backend) -> float:
    """Sum of all parameters in float64 (for FSDP: over every rank's shard,
    with an all_reduce; padding is zero)."""
    local = torch.zeros(1, dtype=torch.float64)
    for p in wrapper.parameters():
        local += p.detach().double().sum()
    if isinstance(wrapper, fg.FSDP):
        backend.all_reduce(local)
    return float(local.item())


def train(
    backend: fg.Backend,
    mode: str,
    steps: int,
    batch: int,
    lr: float,
    hidden: int = 64,
    seed: int = 0,
    on_step: object = None,
) -> tuple[nn.Module, list[float]]:
    """Train ``steps`` steps; returns the wrapper and the per-step global loss
    (the mean of the ranks' slice losses)."""
    rank, world = backend.rank, backend.world_size
    model = build_model(hidden, seed)
    wrapper: nn.Module
    if mode == "ddp":
        ddp = fg.DDP(model, backend)
        wrapper, sync = ddp, ddp.sync_gradients
    elif mode == "fsdp":
        fsdp = fg.FSDP(model, backend)
        wrapper, sync = fsdp, fsdp.sync_gradients
    else:
        raise fg.ConfigError(f"--mode must be ddp or fsdp, got {mode!r}")
    opt = make_optimizer(wrapper.parameters(), lr)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch, seed)
        opt.zero_grad()
        loss = nn.functional.mse_loss(
            wrapper(rank_slice(x, rank, world)), rank_slice(y, rank, world)
        )
        loss.backward()  # type: ignore[no-untyped-call]
        sync()
        opt.step()
        mean_loss = loss.detach().reshape(1).clone()
        backend.all_reduce(mean_loss, "mean")
        losses.append(float(mean_loss.item()))
        if callable(on_step):
            on_step(step, losses[-1], wrapper)
    return wrapper, losses


def train_elastic(
    backend: fg.ElasticBackend,
    steps: int,
    batch: int,
    lr: float,
    hidden: int = 64,
    seed: int = 0,
    on_step: object = None,
    step_sleep: float = 0.0,
) -> tuple[nn.Module, list[float]]:
    """Train ``steps`` steps in an elastic group (DDP): ranks may be lost and
    processes join meanwhile (README, "Elastic training"). Each step's loss
    is the whole batch's, after the step: the same on every member, since
    their parameters are. Returns the wrapper and the losses this process
    saw (a joiner's begin at the step it joined)."""
    model = build_model(hidden, seed)
    ddp = fg.DDP(model, backend)
    opt = make_optimizer(ddp.parameters(), lr)
    state = fg.ElasticState(ddp, opt)
    losses = []
    for step in state.steps(steps):
        x, y = global_batch(step, batch, seed)
        rank, world = backend.rank, backend.world_size
        began = backend.membership.epoch
        opt.zero_grad()
        # Every world_size-th sample: any world size divides the batch.
        loss = nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world])
        loss.backward()  # type: ignore[no-untyped-call]
        ddp.sync_gradients()
        if all(p.grad is None for p in model.parameters()):
            continue  # removed (a stall) and joined again: the step is the group's
        opt.step()
        with torch.no_grad():
            losses.append(float(nn.functional.mse_loss(model(x), y).item()))
        if callable(on_step):
            on_step(step, losses[-1], ddp, (rank, world), began)
        if step_sleep:
            time.sleep(step_sleep)
    return ddp, losses


def train_elastic_fsdp(
    backend: fg.ElasticBackend,
    steps: int,
    batch: int,
    lr: float,
    hidden: int = 64,
    seed: int = 0,
    on_step: object = None,
    step_sleep: float = 0.0,
) -> tuple[nn.Module, list[float]]:
    """Train ``steps`` steps in an elastic group with FSDP, every Linear a
    unit (docs/elastic.md, "Elastic FSDP"): each shard is also kept by a
    buddy, so a lost rank's shards are re-laid over the survivors in
    memory, and a joiner receives its own. A step whose group changed
    while it ran is void (every ``.grad`` None) and runs again over the new
    group. No rank holds the whole model between steps, so each step's loss
    is this rank's slice's, before the step (the group's loss is the mean
    over the members' slices). Returns the wrapper and those losses."""
    model = build_model(hidden, seed)
    fsdp = fg.FSDP(model, backend, units={nn.Linear})  # type: ignore[arg-type]
    opt = make_optimizer(fsdp.parameters(), lr)
    state = fg.ElasticState(fsdp, opt)
    losses = []
    for step in state.steps(steps):
        x, y = global_batch(step, batch, seed)
        rank, world = backend.rank, backend.world_size
        began = backend.membership.epoch
        opt.zero_grad()
        loss = nn.functional.mse_loss(fsdp(x[rank::world]), y[rank::world])
        loss.backward()  # type: ignore[no-untyped-call]
        fsdp.sync_gradients()
        if all(p.grad is None for p in fsdp.parameters()):
            continue  # void: steps() yields this step again, over the new group
        opt.step()
        losses.append(float(loss.item()))
        if callable(on_step):
            on_step(step, losses[-1], fsdp, (rank, world), began)
        if step_sleep:
            time.sleep(step_sleep)
    return fsdp, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=48, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="an elastic group (also FERROGRPC_ELASTIC=1): needs a coordinator",
    )
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds after each step")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.elastic or os.environ.get("FERROGRPC_ELASTIC", "") not in ("", "0"):
        return main_elastic(args, start)
    with fg.init_backend() as backend:
        rank, world = backend.rank, backend.world_size
        emit(
            {
                "event": "joined",
                "rank": rank,
                "world_size": world,
                "address": backend.address,
                "path": backend.data_path,
            }
        )

        def log(step: int, loss: float, wrapper: nn.Module) -> None:
            record = {
                "rank": rank,
                "step": step,
                "loss": round(loss, 10),
                "checksum": checksum(wrapper, backend),
            }
            emit(record)

        train(
            backend, args.mode, args.steps, args.batch, args.lr, args.hidden, args.seed, on_step=log
        )
        backend.barrier()
        emit({"event": "done", "rank": rank, "seconds": round(time.monotonic() - start, 3)})
    return 0


def main_elastic(args: argparse.Namespace, start: float) -> int:
    """An elastic group: DDP's records carry the whole batch's loss after
    the step and the parameters' checksum, the same on every member;
    FSDP's carry this rank's slice loss and the sum of its shards (its own
    part of the model), and its last record the whole model's checksum."""
    fsdp = args.mode == "fsdp"
    with fg.init_backend(elastic=True) as backend:
        emit({"event": "joined", "address": backend.address, "member": not backend.joining})

        def log(
            step: int, loss: float, wrapper: nn.Module, part: tuple[int, int], began: int
        ) -> None:
            record: dict[str, object] = {
                "rank": backend.rank,
                "world_size": backend.world_size,
                "epoch": backend.membership.epoch,
                "slice": part,  # (rank, world_size) when the step began
                "began": began,  # the epoch then: "epoch" differs if the group changed
                "step": step,
            }
            if fsdp:
                # Local: a collective here, after the step, could fail
                # outside the step's recovery.
                shards = torch.cat([p.detach().reshape(-1) for p in wrapper.parameters()])
                record["slice_loss"] = round(loss, 12)
                record["shard_sum"] = float(shards.double().sum().item())
            else:
                record["loss"] = round(loss, 12)
                record["checksum"] = checksum(wrapper, backend)  # type: ignore[arg-type]
            emit(record)

        train_fn = train_elastic_fsdp if fsdp else train_elastic
        wrapper, _ = train_fn(
            backend,
            args.steps,
            args.batch,
            args.lr,
            args.hidden,
            args.seed,
            on_step=log,
            step_sleep=args.step_sleep,
        )
        done: dict[str, object] = {
            "event": "done",
            "rank": backend.rank,
            "seconds": round(time.monotonic() - start, 3),
        }
        if fsdp:
            done["checksum"] = checksum(wrapper, backend)  # type: ignore[arg-type]
        emit(done)
    return 0


def run_and_exit() -> NoReturn:
    """Run :func:`main`, then end the process at once, with its exit status
    (1 and the traceback on an error).

    torch's C++ static destructors take seconds at interpreter exit (3 s on a
    busy 2-core machine, 6 s in a container beside three others), and a
    replica that has failed or finished should be seen to exit when it does:
    compose, a launcher and the tests all go by the exit. ``main`` has closed
    the backend by then; stdout and stderr are flushed first. An argparse
    exit (``--help``, a bad argument) and Ctrl-C go through Python's usual
    exit."""
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
