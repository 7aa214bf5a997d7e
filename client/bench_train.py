"""Training-step benchmark: ferrogrpc DDP/FSDP against torch's own
DistributedDataParallel / FSDP2 (``fully_shard``) on gloo, in the same run.

    python -m client.bench_train --wrapper ddp  --world-size 2
    python -m client.bench_train --wrapper fsdp --world-size 2

The model is an MLP of about 25M float32 parameters; each rank trains on its
own batch. Step time = forward + backward + gradient sync + optimizer step,
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
from typing import Any

from client.bench import collect, rotated
from ferrogrpc.launch import free_port, spawn_ranks


def build_model(width: int, depth: int, device_ms: float = 0.0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(1024, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1024))
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
            return _Wait.apply(x, self.seconds)

    return DeviceTime


def DeviceTime(seconds: float) -> Any:  # noqa: N802 - a module factory
    return _device_time_cls()(seconds)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ferrogrpc as fg

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=rank, world_size=world
    )
    backend = fg.init_backend()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=gen)
    y = torch.randn(args.batch, 1024, generator=gen)

    def model() -> nn.Module:
        return build_model(args.width, args.depth, args.device_ms)

    # name -> (module, gradient sync after backward)
    candidates: dict[str, tuple[nn.Module, Any]] = {}
    if args.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        candidates["torch DDP (gloo)"] = (DistributedDataParallel(model()), None)
        for overlap in (True, False):
            ddp = fg.DDP(model(), backend, overlap=overlap)
            name = f"ferrogrpc DDP overlap={'on' if overlap else 'off'}"
            candidates[name] = (ddp, ddp.sync_gradients)
    else:
        from torch.distributed.fsdp import fully_shard

        sharded = model()
        for layer in sharded:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(sharded)
        candidates["torch FSDP2 fully_shard (gloo)"] = (sharded, None)
        fsdp = fg.FSDP(model(), backend)
        candidates["ferrogrpc FSDP"] = (fsdp, fsdp.sync_gradients)
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
        nn.functional.mse_loss(module(x), y).backward()
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
    parser.add_argument("--depth", type=int, default=1, help="hidden width x width layers")
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "client.bench_train", "--worker", "--gloo-port", str(free_port())]
    cmd += ["--wrapper", args.wrapper, "--width", str(args.width), "--depth", str(args.depth)]
    cmd += ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--device-ms", str(args.device_ms)]
    data = collect(spawn_ranks(args.world_size, cmd, OMP_NUM_THREADS="1"), 1800, "bench_train")
    ranks = data["ranks"]
    print(
        f"# {args.wrapper.upper()} step time, MLP {data['params'] / 1e6:.1f}M float32 params, "
        f"world_size {args.world_size}, batch {args.batch}/rank, median of {args.steps} "
        "interleaved steps (slowest rank)"
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
