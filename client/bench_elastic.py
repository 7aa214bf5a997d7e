"""``ferrogrpc bench --elastic [--fsdp]``: what a lost rank and a joiner cost.

For each state size (parameters plus Adam's two moments, in float32), it
starts a coordinator and N members training an MLP of that size with DDP
(``--fsdp``: FSDP, every Linear a unit, every shard held twice) in an
elastic group, then:

- SIGKILLs one member mid-run: the time from the kill to the survivors'
  next completed step, beside their step time before it;
- starts a replacement: its time from start to its first completed
  (contributing) step, and its state transfer (bytes, seconds, rate);
- in the same run, a bare gRPC stream (grpc.aio, bytes messages, one
  sender, one receiver, no framing or checks) of the same bytes between two
  processes: the ceiling the transfer is compared with.

With ``--fsdp`` the kill costs the survivors a re-shard (the lost rank's
shards re-laid over them from its buddy's copy) and the step that died
runs again; the replacement's transfer is its re-shard: its shards and
the copy it keeps, striped over the members that hold them, as its
metrics report it (``ferrogrpc_fsdp_last_reshard_seconds`` and
``..._received_bytes``, scraped once it completed its first step).

    python -m client.bench --elastic --sizes 100M 400M --nproc 3
    python -m client.bench --elastic --fsdp --sizes 100M --nproc 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from client.common import MiB, fmt_size, parse_size
from client.forks import Fork, popen

RESHARD_SECONDS = "ferrogrpc_fsdp_last_reshard_seconds"
RESHARD_BYTES = "ferrogrpc_fsdp_last_reshard_received_bytes"

MESSAGE = 4 * MiB
# How many of the members' steps after a join count in their pause, and
# how many steps before the kill give a normal step's length.
GROWN = 3
BASELINE = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ------------------------------------------------------------ the worker


def worker(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    import ferrogrpc as fg

    torch.set_num_threads(1)
    if os.environ.get("FERROGRPC_BENCH_LOG"):  # the epochs' and transfers' timings
        import logging

        logging.basicConfig(level=logging.INFO, format="%(created).3f %(name)s %(message)s")
    t0 = time.time()
    # Parameters + two Adam moments, float32: 12 bytes per parameter.
    params = args.state_bytes // 12
    width = 1024
    layers = max(1, params // (width * width))
    backend = fg.init_backend(elastic=True)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    wrapper: fg.DDP | fg.FSDP = (
        fg.FSDP(net, backend, units={nn.Linear})  # type: ignore[arg-type]
        if args.fsdp
        else fg.DDP(net, backend)
    )
    opt = torch.optim.Adam(wrapper.parameters(), lr=1e-4)
    state = fg.ElasticState(wrapper, opt)
    # Adam's moments exist from the first step on: members hold them.
    for step in state.steps(10**9):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        wrapper(x).square().mean().backward()
        wrapper.sync_gradients()
        if args.fsdp and all(p.grad is None for p in wrapper.parameters()):
            continue  # void (the group changed in it): it runs again over the new group
        opt.step()
        record: dict[str, Any] = {
            "step": step,
            "t": time.time(),
            "world": backend.world_size,
            "rank": backend.rank,
            "t0": t0,
        }
        transfer = state.last_transfer
        if transfer is not None:
            record["transfer"] = transfer
            state.last_transfer = None
        print(json.dumps(record), flush=True)
    return 0


# ------------------------------------------------- a bare gRPC stream


async def _bare_receiver(port: int, total: int) -> None:
    import grpc
    import grpc.aio

    done = asyncio.Event()

    async def handler(requests: Any, context: Any) -> bytes:
        async for _ in requests:
            pass
        done.set()
        return b""

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bare", {"S": grpc.stream_unary_rpc_method_handler(handler)}
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("READY", flush=True)
    await done.wait()
    # With a grace: the sender still waits for the answer to its stream,
    # which stop(0) would cancel.
    await server.stop(5.0)


async def _bare_sender(port: int, total: int, repeat: bool) -> float:
    import grpc
    import grpc.aio

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    method = channel.stream_unary("/bare/S", request_serializer=bytes, response_deserializer=bytes)
    call = method(wait_for_ready=True)  # type: ignore[call-arg]
    # The bytes to move, all of them, as the state is: each message is read
    # from its own part of the buffer (one copy into the message, as any
    # sender of tensor bytes makes), not one cached message sent again.
    # (``repeat``: one message, sent again and again, as
    # scripts/grpc_ceiling.py does: the rate of gRPC itself, its source in
    # cache.)
    count = max(1, total // MESSAGE)
    one = os.urandom(MESSAGE)
    data = memoryview(bytearray(one) * (1 if repeat else count))
    start = time.perf_counter()
    for i in range(count):
        await call.write(one if repeat else data[i * MESSAGE : (i + 1) * MESSAGE])
    await call.done_writing()
    await call
    elapsed = time.perf_counter() - start
    await channel.close(None)
    return count * MESSAGE / elapsed


def bare_stream_rate(total: int, repeat: bool = False) -> float:
    """Bytes per second of one bare gRPC stream between two processes."""
    port = _free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-m", "client.bench_elastic", "--bare-receiver", str(port), str(total)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
    )
    try:
        assert receiver.stdout is not None
        receiver.stdout.readline()
        return asyncio.run(_bare_sender(port, total, repeat))
    finally:
        receiver.wait(timeout=60)


# ------------------------------------------------------------ a run


class Run:
    def __init__(self, tmp: Path, nproc: int, state_bytes: int, fsdp: bool = False) -> None:
        self.tmp = tmp
        self.port = _free_port()
        self.env = {
            **os.environ,
            "FERROGRPC_COORDINATOR": f"127.0.0.1:{self.port}",
            "OMP_NUM_THREADS": "1",
        }
        self.cmd = [sys.executable, "-m", "client.bench_elastic", "--worker"]
        self.cmd += ["--state-bytes", str(state_bytes), *(["--fsdp"] if fsdp else [])]
        self.procs: list[Fork | subprocess.Popen[bytes]] = []
        self.coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(nproc)),
                *("--host", "127.0.0.1", "--port", str(self.port)),
            ],
            env=self.env,
            stdout=open(tmp / "coordinator.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        for _ in range(nproc):
            self.start()

    def start(self, metrics_port: int | None = None) -> Fork | subprocess.Popen[bytes]:
        """Start a rank, a fork of client/forks.py's template;
        ``metrics_port``: its metrics there (LOCAL_RANK 0: on that port
        itself)."""
        env = self.env
        if metrics_port is not None:
            env = {**env, "FERROGRPC_METRICS_PORT": str(metrics_port), "LOCAL_RANK": "0"}
        proc = popen(
            self.cmd,
            env=env,
            stdout=open(self.tmp / f"p{len(self.procs)}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def lines(self, n: int | None = None) -> list[dict[str, Any]]:
        out = []
        for i in range(len(self.procs)) if n is None else [n]:
            text = (self.tmp / f"p{i}.log").read_text(errors="replace")
            # Complete lines only: a running process may be writing the last.
            for line in text[: text.rfind("\n") + 1].splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    record["proc"] = i
                    out.append(record)
        return out

    def wait_for(self, check: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.02)
        tails = "\n".join(
            (self.tmp / f"p{i}.log").read_text(errors="replace")[-1500:]
            for i in range(len(self.procs))
        )
        raise RuntimeError(f"{what}: not within {timeout:g}s\n{tails}")

    def close(self) -> None:
        for p in [*self.procs, self.coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()


def reshard_of(port: int) -> dict[str, float]:
    """The last re-shard's seconds and received bytes, from the metrics a
    rank serves on ``port`` (its only rank)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in (RESHARD_SECONDS, RESHARD_BYTES)
    }
    return {"seconds": found.get(RESHARD_SECONDS, 0.0), "bytes": found.get(RESHARD_BYTES, 0.0)}


def measure(nproc: int, state_bytes: int, timeout: float, fsdp: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ferrogrpc-bench-elastic-") as tmp:
        run = Run(Path(tmp), nproc, state_bytes, fsdp)
        try:
            run.wait_for(
                lambda: len([d for d in run.lines() if d["step"] >= BASELINE + 2]) >= nproc,
                timeout,
                "the group training",
            )
            before = [d for d in run.lines(0)]
            # A normal step: the median of the last BASELINE (the steady
            # ones, after the first two).
            ends = [d["t"] for d in before[-BASELINE - 1 :]]
            step_time = statistics.median(b - a for a, b in itertools.pairwise(ends))
            victim = run.procs[-1]
            killed = time.time()
            victim.send_signal(signal.SIGKILL)
            last = max(d["step"] for d in before)
            after = run.wait_for(
                lambda: [d for d in run.lines(0) if d["step"] > last and d["world"] == nproc - 1],
                timeout,
                "the survivors' next step",
            )
            kill_to_step = after[0]["t"] - killed
            metrics_port = _free_port() if fsdp else None
            joiner = run.start(metrics_port)
            started = time.time()
            n = len(run.procs) - 1
            first = run.wait_for(
                lambda: [d for d in run.lines(n) if "step" in d], timeout, "the joiner's step"
            )[0]
            transfer = first.get("transfer") or {}
            if metrics_port is not None:
                # Its shards: the re-shard that admitted it (done before
                # that first step), the only one it took part in.
                reshard = reshard_of(metrics_port)
                transfer = {
                    "bytes": reshard["bytes"],
                    "seconds": reshard["seconds"],
                    "model_bytes": reshard["bytes"],
                    "model_seconds": reshard["seconds"],
                }
            del joiner

            # The members' pause: their first GROWN steps with the joiner
            # (the one that admitted it, and those that still pay for its
            # first use of memory), less as many steps before the kill.
            def grown() -> list[float]:
                mine = run.lines(0)
                steps = [
                    mine[i]["t"] - mine[i - 1]["t"]
                    for i, d in enumerate(mine)
                    if d["step"] > last and d["world"] == nproc
                ]
                return steps if len(steps) >= GROWN else []

            steps = run.wait_for(grown, timeout, "the members' steps with the joiner")
            first_pause = steps[0] - step_time
            pause = sum(steps[:GROWN]) - GROWN * step_time
        finally:
            run.close()
    return {
        "step_s": step_time,
        "kill_to_step_s": kill_to_step,
        "join_to_step_s": first["t"] - started,
        "transfer_bytes": float(transfer.get("bytes", 0)),
        "transfer_s": float(transfer.get("seconds", 0.0)),
        "model_bytes": float(transfer.get("model_bytes", 0)),
        "model_s": float(transfer.get("model_seconds", 0.0)),
        "pause_s": pause,
        "first_pause_s": first_pause,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # (gRPC's own log line when the bare receiver goes away is no news.)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if argv[:1] == ["--bare-receiver"]:
        asyncio.run(_bare_receiver(int(argv[1]), int(argv[2])))
        return 0
    parser = argparse.ArgumentParser(
        prog="ferrogrpc bench --elastic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[100 * 10**6, 400 * 10**6])
    parser.add_argument("--nproc", type=int, default=3, help="members before the kill")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="train with FSDP (units: every Linear; every shard held twice): the kill costs a "
        "re-shard, and the joiner's transfer is its shards",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.fsdp:
        return main_fsdp(args)
    print(
        f"elastic group of {args.nproc} on this machine: SIGKILL one member, then a "
        "replacement joins; a bare gRPC stream of as many bytes, same run"
    )
    header = (
        f"{'state':>8} {'step s':>7} {'kill->step s':>12} {'join->step s':>12} "
        f"{'transfer MB':>11} {'s':>6} {'MB/s':>7} {'model MB':>8} {'s':>6} {'MB/s':>7} "
        f"{'bare MB/s':>9} {'ratio':>6} {'repeat MB/s':>11} {'ratio':>6} {'pause s':>7} {'1st':>6}"
    )
    print(header)
    print("-" * len(header))
    for size in args.sizes:
        m = measure(args.nproc, size, args.timeout)
        bare = bare_stream_rate(int(m["model_bytes"]) or size)
        repeat = bare_stream_rate(int(m["model_bytes"]) or size, repeat=True)
        whole = m["transfer_bytes"] / m["transfer_s"] if m["transfer_s"] else 0.0
        rate = m["model_bytes"] / m["model_s"] if m["model_s"] else 0.0
        print(
            f"{fmt_size(size):>8} {m['step_s']:7.3f} {m['kill_to_step_s']:12.3f} "
            f"{m['join_to_step_s']:12.3f} {m['transfer_bytes'] / 1e6:11.1f} "
            f"{m['transfer_s']:6.3f} {whole / 1e6:7.1f} {m['model_bytes'] / 1e6:8.1f} "
            f"{m['model_s']:6.3f} {rate / 1e6:7.1f} {bare / 1e6:9.1f} "
            f"{rate / bare if bare else 0:6.2f} {repeat / 1e6:11.1f} "
            f"{rate / repeat if repeat else 0:6.2f} {m['pause_s']:7.3f} {m['first_pause_s']:6.3f}",
            flush=True,
        )
    print(
        f"(step s: a member's step before the kill (the median of the last {BASELINE}); "
        "kill->step: from the SIGKILL to the "
        "survivors' next completed step; join->step: from the replacement's start to its "
        "first completed step; transfer: the state it received, striped over every member, "
        "until its last byte landed (its optimizer's part lands during its first step, "
        "beside the members' step); model: the model's part of it, which lands before that "
        "step with nothing else running, and which the ratios compare; bare: one grpc.aio "
        "stream of as many bytes in 4 MiB messages, each read from its "
        "own part of a buffer, two processes; repeat: the same, one cached message sent "
        "again and again (grpc_ceiling.py's way); pause: the members' "
        f"first {GROWN} steps with the joiner (the one that admitted it, and those that "
        f"still pay for its first use of memory), less {GROWN} such steps; 1st: the "
        "step that admitted it alone, less one)"
    )
    return 0


def main_fsdp(args: argparse.Namespace) -> int:
    """``--fsdp``: the kill and the join in elastic FSDP, the joiner's
    shards beside a bare gRPC stream of as many bytes."""
    print(
        f"elastic FSDP group of {args.nproc} on this machine (units: every Linear; every shard "
        "held twice): SIGKILL one member, then a replacement joins; a bare gRPC stream of as "
        "many bytes as the replacement's shards, same run"
    )
    header = (
        f"{'state':>8} {'step s':>7} {'kill->step s':>12} {'join->step s':>12} "
        f"{'shards MB':>9} {'s':>6} {'MB/s':>7} {'bare MB/s':>9} {'ratio':>6} "
        f"{'repeat MB/s':>11} {'ratio':>6} {'pause s':>7} {'1st':>6}"
    )
    print(header)
    print("-" * len(header))
    for size in args.sizes:
        m = measure(args.nproc, size, args.timeout, fsdp=True)
        moved = int(m["model_bytes"]) or size
        bare = bare_stream_rate(moved)
        repeat = bare_stream_rate(moved, repeat=True)
        rate = m["model_bytes"] / m["model_s"] if m["model_s"] else 0.0
        print(
            f"{fmt_size(size):>8} {m['step_s']:7.3f} {m['kill_to_step_s']:12.3f} "
            f"{m['join_to_step_s']:12.3f} {m['model_bytes'] / 1e6:9.1f} {m['model_s']:6.3f} "
            f"{rate / 1e6:7.1f} {bare / 1e6:9.1f} {rate / bare if bare else 0:6.2f} "
            f"{repeat / 1e6:11.1f} {rate / repeat if repeat else 0:6.2f} "
            f"{m['pause_s']:7.3f} {m['first_pause_s']:6.3f}",
            flush=True,
        )
    print(
        f"(step s: a member's step before the kill (the median of the last {BASELINE}); "
        "kill->step: from the SIGKILL to the survivors' next completed step (the re-shard "
        "over them and the step that died, run again); join->step: from the replacement's "
        "start to its first completed step; shards: what the replacement received in the "
        "re-shard that admitted it (its shards and the copy it keeps, parameters and Adam's "
        "moments, striped over the members that hold them) and how long that re-shard took "
        "on it, from its first message to the new layout in effect, as its metrics report "
        "it; bare: one grpc.aio stream of as many bytes in 4 MiB messages, each read from "
        "its own part of a buffer, two processes; repeat: the same, one cached message sent "
        "again and again; pause: the members' "
        f"first {GROWN} steps with the joiner, less {GROWN} such steps; 1st: the step that "
        "admitted it alone, less one)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
