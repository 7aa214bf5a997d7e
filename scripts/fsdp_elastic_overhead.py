"""What elastic FSDP costs while nothing fails: step time and peak RSS of
``fg.FSDP`` with units in an elastic group (every shard held twice, the
gradient handed to its buddy, the copy stepped) beside the same model in a
fixed group, in one run, the two interleaved.

    python scripts/fsdp_elastic_overhead.py --params 25M --nproc 4 --repeats 3

Each run starts a coordinator and ``--nproc`` ranks training an MLP of
``--params`` parameters (square Linear layers, one unit each) with Adam in
float32; a rank reports the median of its step times after the first
``--warmup`` steps and its peak RSS. Printed: per run, the slowest rank's
median step and the largest peak RSS; then the ratios elastic / fixed
(median over the pairs, and their spread), beside what the copy should
add: one shard's parameters and Adam state (3 x params x 4 B / nproc).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from client.common import parse_count, run_group  # noqa: E402

WIDTH = 1024


def worker() -> None:
    import torch
    from torch import nn

    import ferrogrpc as fg

    torch.set_num_threads(1)
    layers = max(1, int(os.environ["PARAMS"]) // (WIDTH * WIDTH + WIDTH))
    steps, warmup = int(os.environ["STEPS"]), int(os.environ["WARMUP"])
    elastic = os.environ["MODE"] == "elastic"
    backend = fg.init_backend(elastic=elastic)
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    fsdp = fg.FSDP(net, backend, units={nn.Linear})
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-4)
    state = fg.ElasticState(fsdp, opt) if elastic else None
    x = torch.randn(8, WIDTH)
    times: list[float] = []
    indices = state.steps(steps) if state is not None else range(steps)
    for _ in indices:
        began = time.perf_counter()
        opt.zero_grad()
        fsdp(x).square().mean().backward()
        fsdp.sync_gradients()
        opt.step()
        times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    median = statistics.median(times[warmup:])
    print(json.dumps({"rank": backend.rank, "step": median, "peak": peak}), flush=True)
    backend.close()
    os._exit(0)


def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    env = {
        **os.environ,
        "PARAMS": str(args.params),
        "STEPS": str(args.steps),
        "WARMUP": str(args.warmup),
        "MODE": mode,
        # (20 s: two cores for N ranks, no member is taken for silent by a
        # busy host; the coordinator forms the first epoch after it, too.)
        "FERROGRPC_HEARTBEAT_TIMEOUT": str(args.heartbeat),
    }
    lines = run_group(__file__, args.nproc, env, args.timeout)
    return {"step": max(d["step"] for d in lines), "peak": max(d["peak"] for d in lines)}


def main() -> int:
    if "--worker" in sys.argv:
        worker()
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=parse_count, default=25_000_000, help="e.g. 25M, 2e5")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--heartbeat", type=float, default=20.0, help="FERROGRPC_HEARTBEAT_TIMEOUT")
    args = parser.parse_args()
    pairs = []
    for i in range(args.repeats):
        order = ("fixed", "elastic") if i % 2 == 0 else ("elastic", "fixed")
        got = {mode: run(mode, args) for mode in order}
        pairs.append(got)
        print(
            f"run {i}: fixed step {got['fixed']['step']:.3f}s peak "
            f"{got['fixed']['peak'] / 2**20:.0f} MiB | elastic step "
            f"{got['elastic']['step']:.3f}s peak {got['elastic']['peak'] / 2**20:.0f} MiB",
            flush=True,
        )
    steps = [p["elastic"]["step"] / p["fixed"]["step"] for p in pairs]
    extra = [(p["elastic"]["peak"] - p["fixed"]["peak"]) / 2**20 for p in pairs]
    shard = 3 * args.params * 4 / args.nproc / 2**20
    print(
        f"elastic / fixed step time: median {statistics.median(steps):.3f} "
        f"(runs {', '.join(f'{r:.3f}' for r in steps)})"
    )
    print(
        f"elastic - fixed peak RSS: median {statistics.median(extra):.0f} MiB "
        f"(runs {', '.join(f'{e:.0f}' for e in extra)}); one shard's parameters and Adam "
        f"state: {shard:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
