"""Training-step benchmark: ferrogrpc DDP/FSDP against torch's own
DistributedDataParallel / FSDP2 (``fully_shard``) on gloo, in the same run.

    python -m client.bench_train --wrapper ddp  --world-size 2
    python -m client.bench_train --wrapper fsdp --world-size 2

For DDP the model is an MLP of about 25M float32 parameters; for FSDP, six
Linear(4096, 4096) layers (403 MB). Each rank trains on its own batch.

FSDP also reports peak memory: for each implementation, a fresh group of
processes builds the model, wraps it and runs one training step; a rank's
figure is its peak RSS (the kernel's high-water mark) over its RSS just
before the model was built, after both backends had run collectives of the
layer size (so their buffers count for neither). torch's FSDP2 shards each
Linear and the root; ferrogrpc runs with ``units={nn.Linear}`` and with
``units=None`` (one unit). Step time = forward + backward + gradient sync + optimizer step,
median over the timed steps, slowest rank. The implementations take turns,
one step each, so that the shared machine's slow and fast spells fall on all
of them alike; "no communication" is one rank's model trained alone, the
floor for the others.

``--device-ms N`` adds N ms after each layer, in forward and in backward,
during which the CPU is free, as it is while a GPU computes: communication
can overlap only with time like that, since on a CPU-only machine backward
already keeps every core busy.

    python -m client.bench_train --wrapper ddp --device-ms 20
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

from client.common import collect, rotated
from ferrogrpc.testing import free_port, spawn_ranks


def build_model(width: int, depth: int, device_ms: float = 0.0, io: int = 1024) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(io, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, io))
    if device_ms > 0:
        # After each layer, a wait in forward and in backward during which
        # the CPU is free: what a GPU computing the layer looks like to the
        # host. Communication can only hide behind time like this.
        layers = [m for layer in layers for m in (layer, DeviceTime(device_ms / 1e3))]
    return nn.Sequential(*layers)


@functools.cache
def _device_time_cls() -> Any:
    import torch
    from torch import nn

    class _Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, seconds: float) -> Any:
            ctx.seconds = seconds
            time.sleep(seconds)
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            time.sleep(ctx.seconds)
            return grad, None

    class DeviceTime(nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def forward(self, x: Any) -> Any:
            return _Wait.apply(x, self.seconds)  # type: ignore[no-untyped-call]

    return DeviceTime


def DeviceTime(seconds: float) -> Any:  # noqa: N802 - a module factory
    return _device_time_cls()(seconds)


FSDP2 = "torch FSDP2 fully_shard per layer (gloo)"
UNITS = "ferrogrpc FSDP units={nn.Linear}"
WHOLE = "ferrogrpc FSDP units=None"


def fsdp_candidate(name: str, module: Any, backend: Any) -> tuple[Any, Any]:
    """``module`` wrapped as ``name`` (one of the FSDP implementations), and
    its gradient sync after backward (None: inside backward)."""
    import torch.nn as nn

    import ferrogrpc as fg

    if name == FSDP2:
        from torch.distributed.fsdp import fully_shard

        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(module)
        return module, None
    fsdp = fg.FSDP(module, backend, units={nn.Linear} if name == UNITS else None)
    return fsdp, fsdp.sync_gradients


def setup(args: argparse.Namespace) -> tuple[int, int, Any, Any, Any]:
    import torch
    import torch.distributed as dist

    import ferrogrpc as fg

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=rank, world_size=world
    )
    backend = fg.init_backend()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.io, generator=gen)
    y = torch.randn(args.batch, args.io, generator=gen)
    return rank, world, backend, x, y


def memory_worker(args: argparse.Namespace) -> None:
    """One implementation's peak RSS for building, wrapping and one step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import ferrogrpc as fg

    rank, world, backend, x, y = setup(args)
    # Both backends run collectives of a layer's size first: their buffers
    # (ferrogrpc's shared-memory slots, gloo's) count for neither.
    layer = torch.ones(args.width * args.width)
    part = torch.ones(args.width * args.width // world)
    for impl in ("gloo", "ferrogrpc"):
        for _ in range(2):
            if impl == "gloo":
                dist.all_reduce(layer)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # renamed in torch 2.13
                    dist.all_gather_into_tensor(layer, part)
            else:
                backend.all_reduce(layer)
                backend.all_gather_into_tensor(layer, part)
                backend.reduce_scatter_tensor(part, layer, "mean")
    del layer, part
    kept: list[Any] = []

    def run() -> None:
        module, sync = fsdp_candidate(
            args.memory, build_model(args.width, args.depth, io=args.io), backend
        )
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        opt.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()  # type: ignore[no-untyped-call]
        if sync is not None:
            sync()
        opt.step()
        kept.append((module, opt))

    dist.barrier()
    before = fg.testing.rss()
    peak = fg.testing.peak_rss(run) - before
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, peak)
    if rank == 0:
        print("RESULT " + json.dumps({"peaks": gathered}), flush=True)
    backend.close()
    dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ferrogrpc as fg

    rank, world, backend, x, y = setup(args)

    def model() -> nn.Module:
        built: nn.Module = build_model(args.width, args.depth, args.device_ms, io=args.io)
        return built

    # name -> (module, gradient sync after backward)
    candidates: dict[str, tuple[nn.Module, Any]] = {}
    if args.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        candidates["torch DDP (gloo)"] = (DistributedDataParallel(model()), None)
        # torch's own DDP over ferrogrpc's torch.distributed backend: a group
        # beside gloo's default one.
        over_fg = dist.new_group(backend="ferrogrpc")
        candidates["torch DDP (ferrogrpc)"] = (
            DistributedDataParallel(model(), process_group=over_fg),
            None,
        )
        for overlap in (True, False):
            ddp = fg.DDP(model(), backend, overlap=overlap)
            name = f"ferrogrpc DDP overlap={'on' if overlap else 'off'}"
            candidates[name] = (ddp, ddp.sync_gradients)
    else:
        for name in (FSDP2, UNITS, WHOLE):
            candidates[name] = fsdp_candidate(name, model(), backend)
    candidates["no communication (local model)"] = (model(), None)
    optimizers = {
        name: torch.optim.SGD(module.parameters(), lr=1e-3)
        for name, (module, _) in candidates.items()
    }

    def step(name: str) -> float:
        module, sync = candidates[name]
        opt = optimizers[name]
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(module(x), y).backward()  # type: ignore[no-untyped-call]
        if sync is not None:
            sync()
        opt.step()
        return time.perf_counter() - start

    for name in candidates:
        for _ in range(args.warmup):
            step(name)
    # One step of each in turn, so that the shared machine's slow and fast
    # spells fall on all of them alike; the order rotates every round,
    # because a step runs measurably slower right after a torch/gloo step
    # (~15 ms here) and no candidate should always be the one that follows.
    results: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for i in range(args.steps):
        for name in rotated(names, i):
            results[name].append(step(name))
    local = candidates["no communication (local model)"][0]
    params = sum(p.numel() for p in local.parameters())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print("RESULT " + json.dumps({"params": params, "ranks": gathered}), flush=True)
    backend.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wrapper", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument(
        "--depth",
        type=int,
        default=None,
        help="hidden width x width layers (default 1 for ddp, 4 for fsdp)",
    )
    parser.add_argument(
        "--io",
        type=int,
        default=None,
        help="input and output width (default 1024 for ddp, 4096 for fsdp)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="simulate device compute: after each layer, wait this long in forward and in "
        "backward with the CPU free (as a GPU would leave it)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="fsdp: skip the peak memory measurement"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    fsdp = args.wrapper == "fsdp"
    args.depth = args.depth if args.depth is not None else (4 if fsdp else 1)
    args.io = args.io if args.io is not None else (4096 if fsdp else 1024)
    if args.worker:
        if args.memory:
            memory_worker(args)
        else:
            worker(args)
        return 0

    def command(*extra: str) -> list[str]:
        cmd = [sys.executable, "-m", "client.bench_train", "--worker"]
        cmd += ["--gloo-port", str(free_port()), "--wrapper", args.wrapper]
        cmd += ["--width", str(args.width), "--depth", str(args.depth), "--io", str(args.io)]
        cmd += ["--batch", str(args.batch), "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup), "--device-ms", str(args.device_ms)]
        return cmd + list(extra)

    peaks: dict[str, list[int]] = {}
    if fsdp and not args.no_memory:
        for name in (FSDP2, UNITS, WHOLE):  # each in fresh processes
            procs = spawn_ranks(args.world_size, command("--memory", name), OMP_NUM_THREADS="1")
            peaks[name] = collect(procs, 1800, "bench_train memory")["peaks"]
    procs = spawn_ranks(args.world_size, command(), OMP_NUM_THREADS="1")
    data = collect(procs, 1800, "bench_train")
    ranks = data["ranks"]
    print(
        f"# {args.wrapper.upper()} step time, MLP {data['params'] / 1e6:.1f}M float32 params "
        f"({data['params'] * 4 / 1e6:.0f} MB), world_size {args.world_size}, batch "
        f"{args.batch}/rank, median of {args.steps} interleaved steps (slowest rank)"
        + (f", simulated device time {args.device_ms:g} ms per layer" if args.device_ms else "")
    )
    names = list(ranks[0])
    medians = {
        name: statistics.median(max(r[name][i] for r in ranks) for i in range(args.steps))
        for name in names
    }
    base = medians[names[0]]
    width = max(len(name) for name in names)
    print(f"{'implementation':<{width}} {'step ms':>9}  vs {names[0]}")
    for name in names:
        print(f"{name:<{width}} {medians[name] * 1e3:9.1f}  {medians[name] / base:.2f}x")
    if peaks:
        print(
            "# FSDP peak RSS of building, wrapping and one training step, over the RSS "
            "before the model was built; fresh processes for each; largest rank (all ranks)"
        )
        first = max(peaks[FSDP2])
        print(f"{'implementation':<{width}} {'peak MiB':>9}  vs {FSDP2}  ranks MiB")
        for name, values in peaks.items():
            mib = [v / 2**20 for v in values]
            print(
                f"{name:<{width}} {max(mib):9.0f}  {max(values) / first:.2f}x  "
                + " ".join(f"{m:.0f}" for m in mib)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
