"""Training-step benchmark: ferrogrpc DDP/FSDP against torch's own
DistributedDataParallel / FSDP2 (``fully_shard``) on gloo, in the same run.

    python -m client.bench_train --wrapper ddp  --world-size 2
    python -m client.bench_train --wrapper fsdp --world-size 2

The model is an MLP of about 25M float32 parameters; each rank trains on its
own batch. Step time = forward + backward + gradient sync + optimizer step,
median over the timed steps, slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from client.bench import collect
from ferrogrpc.launch import free_port, spawn_ranks


def build_model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(1024, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1024))
    return nn.Sequential(*layers)


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
    results: dict[str, Any] = {}

    def time_steps(name: str, model: nn.Module, step_fn: Any) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        times = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            step_fn()
            opt.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        results[name] = times

    params = sum(p.numel() for p in build_model(args.width, args.depth).parameters())
    if args.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        torch_ddp = DistributedDataParallel(build_model(args.width, args.depth))
        time_steps("torch DDP (gloo)", torch_ddp, lambda: None)
        del torch_ddp
        for overlap in (True, False):
            ddp = fg.DDP(build_model(args.width, args.depth), backend, overlap=overlap)
            time_steps(
                f"ferrogrpc DDP overlap={'on' if overlap else 'off'}", ddp, ddp.sync_gradients
            )
            ddp.into_inner()
            del ddp
    else:
        from torch.distributed.fsdp import fully_shard

        model = build_model(args.width, args.depth)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        time_steps("torch FSDP2 fully_shard (gloo)", model, lambda: None)
        del model
        fsdp = fg.FSDP(build_model(args.width, args.depth), backend)
        time_steps("ferrogrpc FSDP", fsdp, fsdp.sync_gradients)
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "client.bench_train", "--worker", "--gloo-port", str(free_port())]
    cmd += ["--wrapper", args.wrapper, "--width", str(args.width), "--depth", str(args.depth)]
    cmd += ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    data = collect(spawn_ranks(args.world_size, cmd, OMP_NUM_THREADS="1"), 1800, "bench_train")
    ranks = data["ranks"]
    print(
        f"# {args.wrapper.upper()} step time, MLP {data['params'] / 1e6:.1f}M float32 params, "
        f"world_size {args.world_size}, batch {args.batch}/rank, median of {args.steps} steps "
        "(slowest rank)"
    )
    names = list(ranks[0])
    medians = {
        name: statistics.median(max(r[name][i] for r in ranks) for i in range(args.steps))
        for name in names
    }
    base = medians[names[0]]
    print(f"{'implementation':<36} {'step ms':>9} {'vs ' + names[0].split(' (')[0]:>18}")
    for name in names:
        print(f"{name:<36} {medians[name] * 1e3:9.1f} {medians[name] / base:17.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
