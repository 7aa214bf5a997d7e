"""What observability costs a DDP training step (issue 32), measured alternated.

    python scripts/observe_overhead.py [--rounds 8] [--steps 8] [--world-size 2]

Each rank (local processes) trains client/bench_train.py's DDP model (an MLP
of about 25M float32 parameters) with ``fg.DDP`` and metrics served
(``metrics_port=0``). A *mode* is what is on for a step:

- ``bare``: no flight recorder either (the observer records nothing): the
  engine as it was before issue 32, to measure the always-on recorder;
- ``off``: the metrics sinks detached from the rank's observer, no scrape
  (the default: the flight recorder alone);
- ``sinks``: the sinks attached (one per ended collective, one per DDP
  bucket wait), no scrape;
- ``metrics``: the sinks attached, and a thread in each rank scraping its
  own endpoint every second, as Prometheus would;
- ``trace``: the trace's sinks alone (``FERROGRPC_TRACE``; written to a
  temporary directory), no metrics.

Every round runs ``--steps`` steps of each mode, the order rotating between
rounds, so that the shared machine's slow and fast spells fall on both
alike. A step is forward + backward + gradient sync + optimizer step, timed
on rank 0 after a barrier. Printed: each round's median per mode, and the
overhead of each mode over ``off`` per round (the spread), then the median
and range over the rounds. Add a mode to MODES to measure another sink.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.bench_train import build_model
from client.common import collect, rotated
from ferrogrpc.testing import spawn_ranks

MODES = ("bare", "off", "sinks", "metrics", "trace")
SCRAPE_S = 1.0


class Scraper:
    """Scrapes ``url`` every SCRAPE_S while on (a thread)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.on = threading.Event()
        self.scrapes = 0
        self.seconds = 0.0  # spent scraping (the rank serving, mostly)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.on.wait()
            start = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as response:
                response.read()
            self.seconds += time.perf_counter() - start
            self.scrapes += 1
            time.sleep(SCRAPE_S)


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import ferrogrpc as fg
    from ferrogrpc.observe import metrics, trace
    from ferrogrpc.runtime.peer import observer_of

    torch.set_num_threads(1)
    backend = fg.init_backend(metrics_port=0)
    rank = backend.rank
    observer = observer_of(backend.peer)
    server = metrics.server_of(observer)
    assert server is not None
    scraper = Scraper(f"http://127.0.0.1:{server.port}/metrics")
    # Every sink and recorder call timed (two clock reads more): their own
    # cost, apart from the step's noise, into [seconds, calls] by what.
    spent, traced, recorder = [0.0, 0], [0.0, 0], [0.0, 0]

    def timed(fn: Callable[..., Any], into: list[Any]) -> Callable[..., Any]:
        def call(*a: Any) -> Any:
            start = time.perf_counter()
            out = fn(*a)
            into[0] += time.perf_counter() - start
            into[1] += 1
            return out

        return call

    attached = (
        [timed(s, spent) for s in observer.collective_sinks],
        [timed(s, spent) for s in observer.span_sinks],
    )
    # The trace's sinks, timed apart.
    writer = trace.attach(observer, tempfile.mkdtemp(prefix="observe-overhead-trace-"))
    trace_sinks = ([timed(writer.collective, traced)], [timed(writer.span, traced)])

    # The flight recorder's calls, timed in the default mode (``off``), and
    # switched off in ``bare``: ``called`` returning None makes the engine
    # skip ``started`` and ``ended`` too.
    calls = {name: getattr(observer, name) for name in ("called", "started", "ended")}

    def set_recorder(mode: str) -> None:
        for name, fn in calls.items():
            if mode == "bare":
                setattr(observer, name, (lambda *a: None) if name == "called" else fn)
            elif mode == "off":
                setattr(observer, name, timed(fn, recorder))
            else:
                setattr(observer, name, fn)

    def set_mode(mode: str) -> None:
        set_recorder(mode)
        on = mode in ("sinks", "metrics")
        observer.collective_sinks[:] = attached[0] if on else []
        observer.span_sinks[:] = attached[1] if on else []
        if mode == "trace":
            observer.collective_sinks[:] = trace_sinks[0]
            observer.span_sinks[:] = trace_sinks[1]
        if mode == "metrics":
            scraper.on.set()
        else:
            scraper.on.clear()

    model = build_model(args.width, args.depth, io=args.io)
    ddp = fg.DDP(model, backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.io, generator=gen)
    y = torch.randn(args.batch, args.io, generator=gen)

    def step() -> float:
        backend.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        ddp.sync_gradients()
        opt.step()
        return time.perf_counter() - start

    for mode in MODES:
        set_mode(mode)
        for _ in range(args.warmup):
            step()
    spent[:] = [0.0, 0]
    recorder[:] = [0.0, 0]
    traced[:] = [0.0, 0]
    trace_steps = 0
    scraper.seconds, scraper.scrapes = 0.0, 0
    sink_steps = 0
    recorder_steps = 0
    rounds: list[dict[str, list[float]]] = []
    for i in range(args.rounds):
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for mode in rotated(list(MODES), i):
            set_mode(mode)
            for _ in range(args.steps):
                times[mode].append(step())
            sink_steps += args.steps if mode in ("sinks", "metrics") else 0
            recorder_steps += args.steps if mode == "off" else 0
            trace_steps += args.steps if mode == "trace" else 0
        rounds.append(times)
    set_mode("off")
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        out = {
            "params": params,
            "rounds": rounds,
            "scrapes": scraper.scrapes,
            "scrape_s": scraper.seconds,
            "sink_s": spent[0],
            "sink_calls": spent[1],
            "sink_steps": sink_steps,
            "recorder_s": recorder[0],
            "recorder_calls": recorder[1],
            "recorder_steps": recorder_steps,
            "trace_s": traced[0],
            "trace_calls": traced[1],
            "trace_steps": trace_steps,
        }
        print("RESULT " + json.dumps(out), flush=True)
    backend.close()


def median_ci(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% interval of the median of ``values`` (order
    statistics: the ranks n/2 -+ 1.96 sqrt(n)/2)."""
    v, n = sorted(values), len(values)
    k = 1.96 * math.sqrt(n) / 2
    return v[max(0, int(n / 2 - k))], v[min(n - 1, math.ceil(n / 2 + k) - 1)]


def report(data: dict[str, Any], args: argparse.Namespace, say: Callable[[str], None]) -> None:
    rounds: list[dict[str, list[float]]] = data["rounds"]
    say(
        f"# DDP step, MLP {data['params'] / 1e6:.1f}M float32 params, world size "
        f"{args.world_size}, batch {args.batch}/rank; {args.rounds} rounds x {args.steps} steps "
        f"per mode, alternated; rank 0 scraped {data['scrapes']} times (every {SCRAPE_S:g} s "
        "while metrics were on)"
    )
    others = [m for m in MODES if m != "off"]
    # bare vs off is the recorder's cost the other way round: report off vs bare.
    say(
        "| round | "
        + " | ".join(f"{m} median ms" for m in MODES)
        + " | "
        + " | ".join(f"{m} vs off" for m in others)
        + " |"
    )
    say("|---" * (1 + len(MODES) + len(others)) + "|")
    overheads: dict[str, list[float]] = {m: [] for m in others}
    for i, times in enumerate(rounds):
        med = {m: statistics.median(t) for m, t in times.items()}
        for m in others:
            overheads[m].append(med[m] / med["off"] - 1)
        cells = " | ".join(f"{med[m] * 1e3:.1f}" for m in MODES)
        overs = " | ".join(f"{overheads[m][-1] * 100:+.2f}%" for m in others)
        say(f"| {i} | {cells} | {overs} |")
    pooled = {m: statistics.median([t for r in rounds for t in r[m]]) for m in MODES}
    step_s = pooled["off"]
    per_step = data["sink_s"] / max(1, data["sink_steps"])
    per_scrape = data["scrape_s"] / max(1, data["scrapes"])
    say(
        f"direct cost on rank 0: the sinks {per_step * 1e6:.0f} us per step "
        f"({data['sink_calls'] / max(1, data['sink_steps']):.0f} calls; "
        f"{per_step / step_s * 100:.3f}% of a step), a scrape {per_scrape * 1e3:.2f} ms "
        f"(once a second: {per_scrape / SCRAPE_S * 100:.2f}% of the rank's time)"
    )
    per_rec = data["recorder_s"] / max(1, data["recorder_steps"])
    say(
        f"direct cost on rank 0: the flight recorder {per_rec * 1e6:.1f} us per step "
        f"({data['recorder_calls'] / max(1, data['recorder_steps']):.0f} calls; "
        f"{per_rec / step_s * 100:.4f}% of a step)"
    )
    per_trace = data["trace_s"] / max(1, data["trace_steps"])
    say(
        f"direct cost on rank 0: the trace's sinks {per_trace * 1e6:.0f} us per step "
        f"({data['trace_calls'] / max(1, data['trace_steps']):.0f} calls; "
        f"{per_trace / step_s * 100:.3f}% of a step)"
    )
    for m in others:
        o = overheads[m]
        if m == "bare":
            o = [1 / (1 + x) - 1 for x in o]  # the recorder: off vs bare
            say(
                "flight recorder (off vs bare): median of the rounds "
                f"{statistics.median(o) * 100:+.2f}% "
                f"(95% interval {median_ci(o)[0] * 100:+.2f}% to {median_ci(o)[1] * 100:+.2f}%) "
                f"(range {min(o) * 100:+.2f}% to {max(o) * 100:+.2f}%); pooled medians "
                f"{pooled['bare'] * 1e3:.1f} ms bare, {pooled['off'] * 1e3:.1f} ms off"
            )
            continue
        say(
            f"{m} vs off: median of the rounds {statistics.median(o) * 100:+.2f}% "
            f"(95% interval {median_ci(o)[0] * 100:+.2f}% to {median_ci(o)[1] * 100:+.2f}%; range "
            f"{min(o) * 100:+.2f}% to {max(o) * 100:+.2f}%); pooled medians "
            f"{pooled['off'] * 1e3:.1f} ms off, {pooled[m] * 1e3:.1f} ms {m} "
            f"({(pooled[m] / pooled['off'] - 1) * 100:+.2f}%)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--io", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
    for name in ("rounds", "steps", "warmup", "width", "depth", "io", "batch"):
        cmd += [f"--{name}", str(getattr(args, name))]
    procs = spawn_ranks(args.world_size, cmd, OMP_NUM_THREADS="1")
    report(collect(procs, 1800, "observe_overhead"), args, print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
