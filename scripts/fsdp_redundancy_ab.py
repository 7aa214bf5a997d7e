"""The two ways to keep every FSDP shard on two ranks (issue 57), measured
side by side on a fixed group, interleaved, beside FSDP with no copy:

- ``grad`` (what elastic FSDP does): after each sync a rank hands its
  reduced gradient shard to its buddy (the next rank), which steps its copy
  of that shard with an optimizer of its own: 1 x the shard's bytes on the
  wire, and a second optimizer step over 1/W of the model;
- ``stream``: after each optimizer step a rank streams its updated shard
  and the optimizer's state (Adam: parameters and two moments, 3 x the
  bytes) to its buddy, in the background: received while the next forward
  and backward run, waited for before the next optimizer step.

    python scripts/fsdp_redundancy_ab.py --params 25M --nproc 4 --repeats 3

Each run starts a coordinator and ``--nproc`` ranks training the model of
scripts/fsdp_elastic_overhead.py (square Linear layers, one unit each,
Adam, float32); a rank reports the median of its step times after
``--warmup`` steps and its peak RSS. Printed per run, the slowest rank's
median step and the largest peak RSS of each way; then each way's ratio to
``none`` (median over the runs, and the spread) and the bytes it adds per
step on each rank. It checks that each copy ends equal to its owner's shard
(``grad``: bitwise; ``stream``: it is the owner's shard).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from client.common import parse_count, run_group  # noqa: E402

WIDTH = 1024
MODES = ("none", "grad", "stream")
TAG = 0xAB000


def worker() -> None:
    import torch
    from torch import nn

    import ferrogrpc as fg

    torch.set_num_threads(1)
    layers = max(1, int(os.environ["PARAMS"]) // (WIDTH * WIDTH + WIDTH))
    steps, warmup, mode = int(os.environ["STEPS"]), int(os.environ["WARMUP"]), os.environ["MODE"]
    backend = fg.init_backend()
    rank, world = backend.rank, backend.world_size
    buddy, owner = (rank + 1) % world, (rank - 1) % world
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    fsdp = fg.FSDP(net, backend, units={nn.Linear})
    params = list(fsdp.parameters())
    opt = torch.optim.Adam(params, lr=1e-4)
    # The copy of the owner's shard (equal sizes: the layers divide evenly).
    copies = [torch.empty_like(p) for p in params]
    for p, c in zip(params, copies, strict=True):
        sent = backend.send(p.detach().contiguous(), buddy, TAG, async_op=True)
        backend.recv(c, owner, TAG)
        sent.wait()
    copy_params = [nn.Parameter(c) for c in copies]
    copy_opt = torch.optim.Adam(copy_params, lr=1e-4) if mode == "grad" else None
    moments: list[torch.Tensor] = []
    pending: list[Any] = []
    x = torch.randn(8, WIDTH)
    times: list[float] = []
    wire = 0
    for _ in range(steps):
        began = time.perf_counter()
        opt.zero_grad()
        fsdp(x).square().mean().backward()
        fsdp.sync_gradients()
        if mode == "grad":
            assert copy_opt is not None
            works = [
                backend.send(p.grad.contiguous(), buddy, TAG, async_op=True)  # type: ignore[union-attr]
                for p in params
            ]
            for cp in copy_params:
                cp.grad = torch.empty_like(cp)
                backend.recv(cp.grad, owner, TAG)
            for w in works:
                w.wait()
            wire += sum(p.numel() * p.element_size() for p in params)
            copy_opt.step()
        elif mode == "stream":
            for w in pending:  # last step's stream: landed before this step
                w.wait()
            pending.clear()
        opt.step()
        if mode == "stream":
            if not moments:
                moments = [torch.empty_like(c) for c in copies for _ in range(2)]
            for i, p in enumerate(params):
                st = opt.state[p]
                for t in (p.detach(), st["exp_avg"], st["exp_avg_sq"]):
                    pending.append(backend.send(t.contiguous(), buddy, TAG, async_op=True))
                    wire += t.numel() * t.element_size()
                for t in (copies[i], moments[2 * i], moments[2 * i + 1]):
                    pending.append(backend.recv(t, owner, TAG, async_op=True))
        times.append(time.perf_counter() - began)
    for w in pending:
        w.wait()
    # The copy equals its owner's shard: the owner sends it, the buddy compares.
    mine = [torch.empty_like(c) for c in copies]
    works = [backend.send(p.detach().contiguous(), buddy, TAG + 1, async_op=True) for p in params]
    for m in mine:
        backend.recv(m, owner, TAG + 1)
    for w in works:
        w.wait()
    equal = mode == "none" or all(torch.equal(a, b) for a, b in zip(mine, copies, strict=True))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    median = statistics.median(times[warmup:])
    line = {"rank": rank, "step": median, "peak": peak, "wire": wire / steps, "equal": equal}
    print(json.dumps(line), flush=True)
    backend.close()
    os._exit(0)


def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    env = {
        **os.environ,
        "PARAMS": str(args.params),
        "STEPS": str(args.steps),
        "WARMUP": str(args.warmup),
        "MODE": mode,
    }
    lines = run_group(__file__, args.nproc, env, args.timeout)
    if not all(d["equal"] for d in lines):
        raise SystemExit(f"{mode}: a copy differs from its owner's shard")
    return {
        "step": max(d["step"] for d in lines),
        "peak": max(d["peak"] for d in lines),
        "wire": max(d["wire"] for d in lines),
    }


def main() -> int:
    if "--worker" in sys.argv:
        worker()
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=parse_count, default=25_000_000)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    modes = tuple(m for m in MODES if m in args.modes)
    runs: list[dict[str, dict[str, float]]] = []
    for i in range(args.repeats):
        order = modes[i % len(modes) :] + modes[: i % len(modes)]  # each way first in turn
        got = {mode: run(mode, args) for mode in order}
        runs.append(got)
        print(
            f"run {i}: "
            + " | ".join(
                f"{m} step {got[m]['step']:.3f}s peak {got[m]['peak'] / 2**20:.0f} MiB"
                for m in modes
            ),
            flush=True,
        )
    for mode in modes:
        if mode == "none" or "none" not in modes:
            print(f"{mode}: {runs[0][mode]['wire'] / 2**20:.1f} MiB per step and rank")
            continue
        ratio = [r[mode]["step"] / r["none"]["step"] for r in runs]
        extra = [(r[mode]["peak"] - r["none"]["peak"]) / 2**20 for r in runs]
        print(
            f"{mode} / none step time: median {statistics.median(ratio):.3f} "
            f"(runs {', '.join(f'{x:.3f}' for x in ratio)}); peak RSS "
            f"{statistics.median(extra):+.0f} MiB; on the wire per step and rank "
            f"{runs[0][mode]['wire'] / 2**20:.1f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
