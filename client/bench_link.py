"""all_reduce over rate-limited links: gloo against ferrogrpc, one rank per
host (``ferrogrpc bench --link RATE[,RTT] ...``).

Each rank runs in a network namespace of its own (client/netlab.py), so
ferrogrpc sees every peer on another host and sends every byte over the
network: gRPC rings, and the TCP mesh for all_reduces of at most 256 KiB.
Each rank's link to the bridge is shaped to RATE each way (tc tbf on both
ends of its veth) and, with RTT, a round trip added by the NFQUEUE delayer
(client/delayer.py), half on each host's way in. Per link, before the
collectives and in the same run:

- with RTT, the delayer's own ceiling: a raw TCP stream through the
  delayers with no rate limit (a user-space process handles every packet;
  the report says whether it is below the link's rate, and so limits it);
- the link's ceiling: a raw TCP stream between two ranks' hosts through the
  same shaping, one way and both ways at once.

Then, per world size and size, torch.distributed's gloo all_reduce and
ferrogrpc's (``fg.init_backend``, its defaults), one call of each in turn,
the order rotating, all ranks starting each call at one agreed instant.
Reported per implementation: the slowest rank's time (median), the
goodput (the bytes each rank must send in a ring all_reduce, 2(n-1)/n x
size, over that time, as a percentage of the link's rate and of the
measured ceiling), ferrogrpc's goodput as a multiple of gloo's, and the
bytes each rank's veth actually sent per all_reduce. Each rank's tensor
holds normal values (seeded by its rank): a constant fill would flatter any
transport that compresses (ferrogrpc packs float32 chunks on slow links,
transport/planes.py). Every result is checked whole against the float64 sum
of every rank's values (``ok``).

    python -m client.bench --link 1gbit 100mbit 100mbit,50ms --world-sizes 2 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client.common import ROOT, MiB, checkout_env, collect, fmt_size, measure, parse_size
from client.netlab import (
    Ceiling,
    Host,
    Link,
    delayed,
    network,
    shape,
    stream_ceiling,
    tx_bytes,
)

IMPLS = ("gloo", "ferrogrpc")
DEFAULT_LINKS = ("1gbit", "100mbit", "100mbit,50ms")
DEFAULT_SIZES = (MiB, 4 * MiB, 16 * MiB)
# ferrogrpc runs an all_reduce of at most this many bytes between hosts as
# one exchange on its TCP mesh, a larger one as gRPC rings (README: small
# collectives).
MESH_MAX = 256 << 10
# Ports inside the namespaces (nothing else listens there), per world size.
GLOO_PORT, FG_PORT = 29500, 29600
# Every call starts this long after rank 0 leaves a barrier, plus two round
# trips: past the other ranks' exits and the broadcast of the instant.
START_LEAD_S = 0.02
# The bench sets each rank's rendezvous and addresses itself; the other
# FERROGRPC_* options of its environment (chunk size, lanes, checksum...)
# pass to the ranks, and the report names them.
NOT_PASSED = frozenset(
    {
        *("MASTER_ADDR", "MASTER_PORT", "FERROGRPC_COORDINATOR", "FERROGRPC_PORT"),
        *("FERROGRPC_BIND_HOST", "FERROGRPC_ADVERTISE_HOST", "FERROGRPC_ELASTIC"),
        "FERROGRPC_MIN_WORLD_SIZE",
    }
)
# A delayer that reaches less than this share of the link's rate limits it.
DELAYER_MARGIN = 1.0
# The delayer's streams, in link ceiling streams' lengths.
DELAYER_STREAM = 4


class _Counted:
    """One implementation's all_reduce of its own tensor, as a timed call:
    the bytes this host's link sent for each call, and whether every result
    was right, whole (within float32's rounding of ``expected``).

    A rank's all_reduce can return while its last bytes still wait in its
    link's queue (its peers have not received them yet), so a call's bytes
    are counted up to the end of a barrier after it (``settle``; untimed),
    less what such a barrier sends itself (``settle_bytes``)."""

    def __init__(
        self,
        call: Callable[[Any], object],
        tensor: Any,
        fill: Any,
        expected: Any,
        device: str,
        settle: Callable[[], object],
        settle_bytes: int,
        world: int,
    ) -> None:
        self._call = call
        self._tensor = tensor
        self._fill = fill
        self._expected = expected
        self._device = device
        self._settle = settle
        self._settle_bytes = settle_bytes
        self._world = world
        self._before = 0
        self.sent: list[int] = []
        self.ok = True

    def prepare(self) -> None:
        self._tensor.copy_(self._fill)

    def __call__(self) -> None:
        self._before = tx_bytes(self._device)
        self._call(self._tensor)

    def check(self) -> None:
        self._settle()
        self.sent.append(tx_bytes(self._device) - self._before - self._settle_bytes)
        # A float32 sum of ``world`` normal values is within world x 1e-5
        # of their float64 sum, in any order (|partial sums| < 2^5 here).
        error = float((self._tensor.double() - self._expected).abs().max())
        self.ok = self.ok and error <= 1e-5 * self._world


def _values(n: int, rank: int, world: int) -> tuple[Any, Any]:
    """This rank's ``n`` normal values (seeded by its rank), and the float64
    sum of every rank's."""
    import torch

    def of(r: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(1000 + r))

    total = torch.zeros(n, dtype=torch.float64)
    mine = torch.empty(0)
    for r in range(world):
        values = of(r)
        total += values
        if r == rank:
            mine = values
    return mine, total


def _bytes_of(call: Callable[[], object], device: str, times: int = 5) -> int:
    """The bytes this host's link sends for ``call`` (the median of ``times``)."""
    sent = []
    for _ in range(times):
        before = tx_bytes(device)
        call()
        sent.append(tx_bytes(device) - before)
    return int(statistics.median(sent))


def worker(args: argparse.Namespace) -> None:
    """One rank, in its host's namespace: gloo and ferrogrpc all_reduces,
    interleaved; rank 0 prints every rank's results after RESULT."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ferrogrpc as fg

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.gloo_port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.timeout),
    )
    backend = fg.init_backend(rank, world, args.master, args.fg_port)
    lead = START_LEAD_S + 2 * args.rtt

    def clock_start() -> float:
        """Every rank starts at one agreed instant (the namespaces share
        one host's monotonic clock): no barrier's uneven exit is timed."""
        dist.barrier()
        at = torch.tensor([time.monotonic() + lead], dtype=torch.float64)
        dist.broadcast(at, 0)
        began = float(at.item())
        time.sleep(max(0.0, began - time.monotonic()))
        return began

    rows = []
    barrier_bytes = _bytes_of(dist.barrier, args.device)
    for size in args.sizes:
        mine, expected = _values(size // 4, rank, world)
        runs = {
            impl: _Counted(
                call,
                torch.empty(size // 4),
                mine,
                expected,
                args.device,
                dist.barrier,
                barrier_bytes,
                world,
            )
            for impl, call in (("gloo", dist.all_reduce), ("ferrogrpc", backend.all_reduce))
        }
        counted_before = fg.testing.stats(backend).bytes_sent
        times = measure(
            dict(runs),
            dist.barrier,
            args.iters,
            args.warmup,
            before={impl: run.prepare for impl, run in runs.items()},
            after={impl: run.check for impl, run in runs.items()},
            start=clock_start,
        )
        counted_bytes = fg.testing.stats(backend).bytes_sent - counted_before
        rows.append(
            {
                "size": size,
                "times": times,
                # The warm-up calls came first.
                "wire": {impl: run.sent[args.warmup :] for impl, run in runs.items()},
                "fg_counted": counted_bytes / (args.iters + args.warmup),
                "ok": {impl: run.ok for impl, run in runs.items()},
            }
        )
        del runs, mine, expected
    result = {
        "rank": rank,
        "path": backend.data_path,
        "barrier_bytes": barrier_bytes,
        "rows": rows,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    backend.close()
    dist.destroy_process_group()


def _rank_env(rank: int, world: int, device: str) -> dict[str, str]:
    env = checkout_env(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # gloo binds where its host name resolves; this host's link is the
        # veth.
        GLOO_SOCKET_IFNAME=device,
        # Not c10d's warning that no name resolves for the other hosts'
        # addresses (the namespaces have no DNS).
        TORCH_CPP_LOG_LEVEL="ERROR",
    )
    return {k: v for k, v in env.items() if k not in NOT_PASSED}


def _fg_options() -> list[str]:
    """The FERROGRPC_* options of this environment that the ranks get."""
    return sorted(
        f"{k}={v}"
        for k, v in os.environ.items()
        if k.startswith("FERROGRPC_") and k not in NOT_PASSED
    )


def run_world(
    hosts: list[Host], world: int, link: Link, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """``world`` ranks, rank r in ``hosts[r]``'s namespace; each rank's results."""
    slot = sorted(args.world_sizes).index(world)
    cmd = [sys.executable, "-m", "client.bench_link", "--worker"]
    cmd += ["--master", hosts[0].address, "--rtt", str(link.rtt)]
    cmd += ["--gloo-port", str(GLOO_PORT + slot), "--fg-port", str(FG_PORT + slot)]
    cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup)]
    cmd += ["--timeout", str(args.timeout), "--sizes", *[str(s) for s in args.sizes]]
    procs = []
    for rank in range(world):
        procs.append(
            subprocess.Popen(
                hosts[rank].run(*cmd, "--device", hosts[rank].device),
                env=_rank_env(rank, world, hosts[rank].device),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    try:
        return list(collect(procs, args.timeout, f"bench --link world {world}"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:.1f} Mbit/s"


def summarize(
    world: int, link: Link, ceiling: Ceiling, per_rank: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per size and implementation: the figures of the report."""
    ring = 2.0 * (world - 1) / world
    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        size = row["size"]
        ring_bytes = ring * size
        med = {}
        spread = {}
        for impl in IMPLS:
            iters = len(row["times"][impl])
            slowest = [max(r["rows"][i]["times"][impl][k] for r in per_rank) for k in range(iters)]
            med[impl] = statistics.median(slowest)
            spread[impl] = (min(slowest), max(slowest))
        for impl in IMPLS:
            goodput = ring_bytes * 8 / med[impl]
            wire = [w for r in per_rank for w in r["rows"][i]["wire"][impl]]
            rows.append(
                {
                    "size": size,
                    "impl": impl,
                    "path": "gloo"
                    if impl == "gloo"
                    else ("tcp mesh" if size <= MESH_MAX else "grpc ring"),
                    "ms": med[impl] * 1e3,
                    "ms_min": spread[impl][0] * 1e3,
                    "ms_max": spread[impl][1] * 1e3,
                    "goodput_bps": goodput,
                    "goodput_pct_link": 100 * goodput / link.rate,
                    "goodput_pct_ceiling": 100 * goodput / ceiling.both_ways,
                    "x_gloo": med["gloo"] / med[impl],
                    "ring_bytes": ring_bytes,
                    "wire_bytes": statistics.mean(wire),
                    "wire_x_ring": statistics.mean(wire) / ring_bytes,
                    "ok": all(r["rows"][i]["ok"][impl] for r in per_rank),
                }
            )
            if impl == "ferrogrpc":
                # What ferrogrpc itself counts as sent per call (payload).
                counted = statistics.mean(r["rows"][i]["fg_counted"] for r in per_rank)
                rows[-1]["fg_counted_bytes"] = counted
    paths = sorted({r["path"] for r in per_rank})
    barrier = max(r["barrier_bytes"] for r in per_rank)
    return {"world": world, "data_path": paths, "barrier_bytes": barrier, "rows": rows}


def report_world(summary: dict[str, Any], iters: int, cpu: str) -> str:
    lines = [
        f"## world {summary['world']}: ferrogrpc data path {', '.join(summary['data_path'])} "
        f"(every rank){cpu}",
        f"{'size':>8} {'impl':<10} {'path':<9} {'ms':>8} {'min-max':>15} {'%link':>6} "
        f"{'%ceil':>6} {'x gloo':>6} {'wire MB':>8} {'x ring':>6} {'ok':>3}",
    ]
    for row in summary["rows"]:
        lines.append(
            f"{fmt_size(row['size']):>8} {row['impl']:<10} {row['path']:<9} {row['ms']:8.1f} "
            f"{row['ms_min']:7.1f}-{row['ms_max']:<7.1f} {row['goodput_pct_link']:6.1f} "
            f"{row['goodput_pct_ceiling']:6.1f} {row['x_gloo']:6.2f} "
            f"{row['wire_bytes'] / 1e6:8.2f} {row['wire_x_ring']:6.3f} "
            f"{'yes' if row['ok'] else 'NO':>3}"
        )
    return "\n".join(lines)


def legend(iters: int) -> str:
    return (
        f"# time: the slowest rank's, median of {iters} interleaved iterations (all ranks start "
        "each call at one agreed instant); goodput: the bytes each rank must send in a ring "
        "all_reduce, 2(n-1)/n x size, x 8 / time; %link: goodput as a percentage of the link's "
        "rate, %ceil: of the raw TCP ceiling both ways at once; x gloo: ferrogrpc's goodput / "
        "gloo's (higher is better); wire MB: bytes each rank's veth sent per all_reduce (mean "
        "over ranks and iterations; headers count once per TSO segment of up to 64 KiB), "
        "x ring: wire / 2(n-1)/n x size"
    )


def run_link(link: Link, args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """One link: its ceilings, then every world size. Prints as it goes;
    returns whether everything was right, and the figures."""
    names = [f"rank{i}" for i in range(max(args.world_sizes))]
    print(
        f"# link: {Link(link.rate)} each way per rank (tc tbf on both ends of each rank's veth)"
        + (
            f", {link.rtt * 1e3:g} ms round trip (NFQUEUE delayer, {link.rtt * 1e3 / 2:g} ms "
            "on each host's way in)"
            if link.rtt
            else ""
        ),
        flush=True,
    )
    nbytes = max(1 << 20, int(link.rate / 8 * args.ceiling_s))
    out: dict[str, Any] = {"link": {"rate_bps": link.rate, "rtt_s": link.rtt}, "worlds": []}
    good = True
    with network(names) as net, delayed(net, link.rtt) as delayers:
        hosts = list(net.hosts.values())
        if link.rtt:
            # Long enough for TCP to ramp up to the delayer's own ceiling.
            alone = stream_ceiling(hosts[0], hosts[1], DELAYER_STREAM * nbytes)
            limits = min(alone.one_way, alone.both_ways) < DELAYER_MARGIN * link.rate
            print(
                f"# the delayer alone (same round trip, no rate limit; "
                f"{DELAYER_STREAM * nbytes / 1e6:.1f} MB streams): {_mbit(alone.one_way)} one way, "
                f"{_mbit(alone.both_ways)} each way both at once: "
                + (
                    "BELOW THE LINK'S RATE: the delayer limits this link"
                    if limits
                    else "above the link's rate: it does not limit the link"
                ),
                flush=True,
            )
            out["delayer"] = {"one_way_bps": alone.one_way, "both_ways_bps": alone.both_ways}
            out["delayer_limits"] = limits
        shape(net, link.rate)
        ceiling = stream_ceiling(hosts[0], hosts[1], nbytes)
        out["ceiling"] = {"one_way_bps": ceiling.one_way, "both_ways_bps": ceiling.both_ways}
        print(
            f"# ceiling: a raw TCP stream between two ranks' hosts through the same shaping "
            f"({nbytes / 1e6:.1f} MB, its second half): {_mbit(ceiling.one_way)} one way "
            f"({100 * ceiling.one_way / link.rate:.1f}% of the link), "
            f"{_mbit(ceiling.both_ways)} each way both at once "
            f"({100 * ceiling.both_ways / link.rate:.1f}%)",
            flush=True,
        )
        print(legend(args.iters), flush=True)
        for world in args.world_sizes:
            cpu_before = [_cpu_s(p.pid) for p in delayers]
            began = time.monotonic()
            per_rank = run_world(hosts, world, link, args)
            cpu = ""
            if delayers:
                used = sum(_cpu_s(p.pid) for p in delayers) - sum(cpu_before)
                wall = time.monotonic() - began
                cpu = f"; delayers' CPU {used:.1f} s in {wall:.1f} s ({used / wall:.2f} of a core)"
            summary = summarize(world, link, ceiling, per_rank)
            text = report_world(summary, args.iters, cpu)
            print(text, flush=True)
            good &= summary["data_path"] == ["grpc"] and all(r["ok"] for r in summary["rows"])
            out["worlds"].append(summary)
    return good, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ferrogrpc bench --link",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--link",
        nargs="*",
        type=Link.parse,
        help="RATE[,RTT] per link, e.g. 1gbit 100mbit,50ms (given alone: "
        + " ".join(DEFAULT_LINKS)
        + ")",
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--ceiling-s", type=float, default=1.0, help="the ceiling streams' length at the link rate"
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--rtt", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fg-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if os.geteuid() != 0:
        print("ferrogrpc bench --link needs root (ip netns, tc, iptables)", file=sys.stderr)
        return 2
    # A SIGTERM (timeout, a CI's cancel) unwinds, so the namespaces go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    links = args.link or [Link.parse(text) for text in DEFAULT_LINKS]
    if any(link.rate == 0 for link in links):
        parser.error("--link needs a rate")
    if min(args.world_sizes) < 2:
        parser.error("--world-sizes: at least 2 (one rank per host)")
    print(
        "ferrogrpc bench --link: all_reduce float32, gloo and ferrogrpc "
        f"({', '.join(_fg_options()) or 'its defaults: checksum on'}), one rank per network "
        f"namespace, sizes {', '.join(fmt_size(s) for s in args.sizes)}, {os.cpu_count()} CPUs",
        flush=True,
    )
    good = True
    figures = []
    for link in links:
        ok, out = run_link(link, args)
        good &= ok
        figures.append(out)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    print(
        "# results ok"
        if good
        else "# RESULTS NOT OK (a wrong result, or not every byte over the network)"
    )
    return 0 if good else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
