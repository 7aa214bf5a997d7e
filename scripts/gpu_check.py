"""End-to-end check of ferrogrpc on CUDA tensors, for a machine with a GPU.

    PYTHONPATH=. python3 scripts/gpu_check.py            # two ranks share GPU 0
    PYTHONPATH=. python3 scripts/gpu_check.py --device cpu --quick   # smoke test

Installs nothing: needs torch, grpcio and protobuf in python3 (numpy, isal
and grpcio-health-checking are optional). Two processes at world size 2:

1. every collective on CUDA tensors (several dtypes and sizes, a non-default
   user stream, a non-contiguous tensor) against a float64 reference;
2. DDP and FSDP (one unit, and ``units={nn.Linear}``) training of a CUDA
   model on slices of a batch against single-process training on the whole
   batch;
3. all_reduce bus bandwidth, ferrogrpc against gloo with CUDA tensors, at 1,
   16 and 256 MiB;
4. DDP step time of a 25M-parameter MLP with overlap on and off, and
   without communication (on a GPU, backward leaves the CPU free, so overlap
   on should be faster: issue 3's bar, which the CPU-only machine cannot
   show).

It prints a short table last and exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_collectives(backend: Any, device: Any, log: list[str]) -> int:
    import torch

    rank, world = backend.rank, backend.world_size
    failures = 0

    def inputs(numel: int, dtype: Any, seed: int) -> list[Any]:
        return [
            torch.randint(
                -8, 9, (numel,), generator=torch.Generator().manual_seed(seed * 31 + r)
            ).to(dtype)
            for r in range(world)
        ]

    def expect(name: str, ok: bool) -> None:
        nonlocal failures
        if not ok:
            failures += 1
            log.append(f"FAIL {name}")

    seed = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for numel in (0, 1, 1000, (1 << 20) + 3):
            seed += 1
            host = inputs(numel, dtype, seed)
            ref = (
                torch.stack([h.double() for h in host]).sum(0)
                if numel
                else torch.zeros(0, dtype=torch.float64)
            )
            t = host[rank].to(device, copy=True)
            backend.all_reduce(t)
            expect(
                f"all_reduce {dtype} {numel}",
                t.device == device and torch.equal(t.double().cpu(), ref),
            )
            if dtype.is_floating_point:
                t = host[rank].to(device, copy=True)
                backend.all_reduce(t, "mean")
                expect(
                    f"mean {dtype} {numel}",
                    torch.allclose(t.double().cpu(), ref / world, atol=1e-2),
                )
            t = host[rank].to(device, copy=True)
            backend.all_reduce(t, "max")
            mx = torch.stack([h.double() for h in host]).max(0).values if numel else ref
            expect(f"max {dtype} {numel}", torch.equal(t.double().cpu(), mx))
            gathered = backend.all_gather(host[rank].to(device, copy=True))
            expect(
                f"all_gather {dtype} {numel}",
                all(torch.equal(g.cpu(), host[r]) for r, g in enumerate(gathered)),
            )
            out = torch.empty(world * numel, dtype=dtype, device=device)
            backend.all_gather_into_tensor(out, host[rank].to(device, copy=True))
            expect(
                f"all_gather_into_tensor {dtype} {numel}", torch.equal(out.cpu(), torch.cat(host))
            )
            part = backend.reduce_scatter(host[rank].to(device, copy=True))
            expect(
                f"reduce_scatter {dtype} {numel}",
                part.device == device
                and torch.equal(part.double().cpu(), torch.tensor_split(ref, world)[rank]),
            )
            b = host[rank].to(device, copy=True)
            backend.broadcast(b, root=world - 1)
            expect(f"broadcast {dtype} {numel}", torch.equal(b.cpu(), host[world - 1]))
    if device.type == "cuda":
        # Ordering with a non-default user stream: the input is produced by a
        # kernel on that stream, the result consumed by another.
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            x = torch.full((4 << 20,), float(rank + 1), device=device) * 3.0
            backend.all_reduce(x)
            y = x * 2.0
        stream.synchronize()
        expected = 2.0 * 3.0 * sum(range(1, world + 1))
        expect("user stream ordering", bool((y == expected).all().item()))
    # Non-contiguous.
    base = (torch.arange(12.0) * (rank + 1)).reshape(3, 4).to(device)
    backend.all_reduce(base.t())
    expect(
        "non-contiguous",
        torch.equal(base.cpu(), torch.arange(12.0).reshape(3, 4) * sum(range(1, world + 1))),
    )
    log.append(f"collectives: {seed} dtype/size cases x 7 ops, {failures} failures")
    return failures


def check_training(backend: Any, device: Any, log: list[str], steps: int) -> int:
    import torch
    from torch import nn

    import ferrogrpc as fg

    rank, world = backend.rank, backend.world_size
    failures = 0

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5)).double().to(device)

    def batch(step: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(12, 7, generator=g, dtype=torch.float64).to(device), torch.randn(
            12, 5, generator=g, dtype=torch.float64
        ).to(device)

    ref = model()
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    per = 12 // world
    for name in ("ddp", "fsdp", "fsdp-units"):
        inner = model()
        wrapper: Any
        if name == "ddp":
            wrapper = fg.DDP(inner, backend)
        elif name == "fsdp":
            wrapper = fg.FSDP(inner, backend)
        else:  # per-layer gathers and reduce-scatters from autograd hooks
            wrapper = fg.FSDP(inner, backend, units={nn.Linear})
        opt = torch.optim.Adam(wrapper.parameters(), lr=0.01)
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(
                wrapper(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
            ).backward()
            wrapper.sync_gradients()
            opt.step()
        fsdp = name.startswith("fsdp")
        state = wrapper.full_state_dict() if fsdp else wrapper.state_dict()
        diff = max(
            float((state[k].double() - v.double()).abs().max()) for k, v in ref.state_dict().items()
        )
        on_device = all(t.device == device for t in state.values())
        ok = diff <= 1e-5 and on_device
        failures += 0 if ok else 1
        log.append(
            f"{name.upper()} on {device}: max |diff| vs single process {diff:.2e} "
            f"({'ok' if ok else 'FAIL'})"
        )
    return failures


def bench(backend: Any, device: Any, sizes: list[int], iters: int) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    world = backend.world_size
    rows = []
    for size in sizes:
        t = torch.ones(size // 4, device=device)
        result: dict[str, float] = {"size": size}
        for impl in ("gloo", "ferrogrpc"):
            times = []
            for i in range(iters + 1):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                if impl == "gloo":
                    dist.all_reduce(t)
                else:
                    backend.all_reduce(t)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:
                    times.append(time.perf_counter() - start)
            result[impl] = statistics.median(times)
        factor = 2 * (world - 1) / world
        result["gloo_busbw"] = size / result["gloo"] * factor / 1e9
        result["fg_busbw"] = size / result["ferrogrpc"] * factor / 1e9
        rows.append(result)
    return rows


def time_ddp(backend: Any, device: Any, width: int, steps: int) -> dict[str, float]:
    """Median step time of DDP with overlap on and off, and of the model
    without communication, interleaved step by step. On a GPU, backward
    leaves the CPU free, so overlap on should beat overlap off (issue 3's
    bar, which a CPU-only machine cannot show)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import ferrogrpc as fg

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(1024, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 1024),
        ).to(device)

    gen = torch.Generator().manual_seed(backend.rank)
    x = torch.randn(64, 1024, generator=gen).to(device)
    y = torch.randn(64, 1024, generator=gen).to(device)
    candidates: dict[str, tuple[nn.Module, Any]] = {"no communication": (model(), None)}
    for overlap in (True, False):
        ddp = fg.DDP(model(), backend, overlap=overlap)
        candidates[f"DDP overlap={'on' if overlap else 'off'}"] = (ddp, ddp.sync_gradients)
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-4) for n, (m, _) in candidates.items()}
    times: dict[str, list[float]] = {n: [] for n in candidates}
    for i in range(steps + 2):
        for name, (module, sync) in candidates.items():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            optimizers[name].zero_grad()
            nn.functional.mse_loss(module(x), y).backward()
            if sync is not None:
                sync()
            optimizers[name].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import ferrogrpc as fg

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        device = torch.device(
            "cuda", args.gpu if args.gpu >= 0 else rank % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.gloo_port}",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    log: list[str] = []
    failures = 0
    with fg.init_backend() as backend:
        start = time.monotonic()
        failures += check_collectives(backend, device, log)
        failures += check_training(backend, device, log, steps=3 if args.quick else 6)
        log.append(f"correctness checks took {time.monotonic() - start:.1f}s")
        sizes = [1 * MiB, 16 * MiB] if args.quick else [1 * MiB, 16 * MiB, 256 * MiB]
        rows = bench(backend, device, sizes, iters=2 if args.quick else 5)
        ddp_times = time_ddp(
            backend, device, width=256 if args.quick else 4096, steps=2 if args.quick else 9
        )
    dist.destroy_process_group()
    result = {"rank": rank, "failures": failures, "log": log, "rows": rows, "ddp": ddp_times}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--gpu", type=int, default=0, help="GPU both ranks share (-1: one per rank)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--timeout", type=float, default=280)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    started = time.monotonic()
    port, gloo_port = free_port(), free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--gloo-port", str(gloo_port)]
        cmd += ["--device", args.device, "--gpu", str(args.gpu)] + (
            ["--quick"] if args.quick else []
        )
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=args.timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print(f"gpu_check: timed out after {args.timeout}s")
            return 2
    results = []
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            print(f"--- rank {rank} failed (exit {p.returncode}):\n{out[-4000:]}")
            return 1
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    for line in results[0]["log"]:
        print(line)
    failures = sum(r["failures"] for r in results)
    print(f"\n# all_reduce float32 on {args.device}, world_size 2, median (ranks share the device)")
    print(
        f"{'size':>8} {'gloo ms':>9} {'gloo busbw':>11} {'fg ms':>9} {'fg busbw':>9} {'fg/gloo':>8}"
    )
    for row in results[0]["rows"]:
        size = int(row["size"])
        print(
            f"{size // MiB:>5} MiB {row['gloo'] * 1e3:9.2f} {row['gloo_busbw']:6.3f} GB/s "
            f"{row['ferrogrpc'] * 1e3:9.2f} {row['fg_busbw']:9.3f} "
            f"{row['fg_busbw'] / row['gloo_busbw']:8.2f}"
        )
    print(f"\n# DDP step time on {args.device}, world_size 2, MLP, median of interleaved steps")
    ddp = {name: max(r["ddp"][name] for r in results) for name in results[0]["ddp"]}
    for name, seconds in ddp.items():
        print(f"{name:<20} {seconds * 1e3:9.1f} ms")
    on, off = ddp["DDP overlap=on"], ddp["DDP overlap=off"]
    print(f"overlap on / off: {on / off:.2f} (below 1: overlap hides communication)")
    verdict = "all checks passed" if failures == 0 else f"{failures} check(s) FAILED"
    print(f"gpu_check: {verdict} in {time.monotonic() - started:.0f}s")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
