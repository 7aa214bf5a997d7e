"""What elastic FSDP's recovery costs: a rank SIGKILLed at 4 -> 3 ranks, then
a joiner at 3 -> 4, on a model of ``--params`` float32 parameters (25M: 100
MB of parameters, 300 MB with Adam's state) with units.

    python scripts/fsdp_elastic_recovery.py --params 25M --nproc 4 --repeats 3

Each repeat starts a coordinator and ``--nproc`` ranks (the model of
scripts/fsdp_elastic_overhead.py: square Linear layers, one unit each,
Adam). After ``--warmup`` steps, rank 1 SIGKILLs itself: before its forward,
inside the last unit's forward, or halfway through backward (the repeats
take them in turn). Printed per repeat:

- the step time before the kill (the slowest rank's median);
- kill (the moment it dies) -> the survivors' next completed step (the bar:
  <= step + 1 s);
- the joiner, a cold process started once the survivors made two steps:
  the bytes of shards it received in its re-shard, the seconds the whole
  re-shard took (the new epoch's first collectives, the plan, the
  allocation, the transfer), and the rate at which they arrived once the
  exchange began (from the joiner's start of the exchange, after the plan:
  allocating its planes, posting its receives, to the last message's end),
  beside a bare gRPC stream's on this machine (raw bytes from one process
  to another with grpc.aio, 1 MiB messages, the same byte count; the bar:
  >= 70% of it). Beside it, what the whole group received in that
  re-shard (every member's pieces: on two cores the joiner's transfer
  shares them with the members' own) over the same bare rate.

The data path is gRPC (FERROGRPC_SHM=0), as between hosts, so that the two
rates compare like with like.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from client.common import parse_count  # noqa: E402

WIDTH = 1024
KILLS = ("before", "forward", "backward")


def worker() -> None:
    import torch
    from torch import nn

    import ferrogrpc as fg

    torch.set_num_threads(1)
    layers = max(1, int(os.environ["PARAMS"]) // (WIDTH * WIDTH + WIDTH))
    out_dir = Path(os.environ["OUT_DIR"])
    backend = fg.init_backend(elastic=True, min_world_size=2)
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    fsdp = fg.FSDP(net, backend, units={nn.Linear})
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-4)
    state = fg.ElasticState(fsdp, opt)
    x = torch.randn(8, WIDTH)
    joiner = backend.joining
    print(json.dumps({"event": "start", "joiner": joiner, "t": time.time()}), flush=True)
    last_move = None
    for step in state.steps(int(os.environ["STEPS"])):
        kill = out_dir / "kill"
        if backend.rank == 1 and not joiner and kill.exists():
            try:
                at = kill.read_text()
                kill.unlink()  # one process only
            except FileNotFoundError:
                at = ""
            if at:
                print(json.dumps({"event": "kill", "at": at, "t": time.time()}), flush=True)

                def die(*_: Any) -> None:
                    # (The moment of death, which the recovery is timed from.)
                    print(json.dumps({"event": "died", "t": time.time()}), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

                if at == "before":
                    die()
                elif at == "forward":
                    net[-1].register_forward_pre_hook(die)
                else:
                    net[layers // 2].weight.register_hook(die)
        opt.zero_grad()
        fsdp(x).square().mean().backward()
        fsdp.sync_gradients()
        opt.step()
        if all(p.grad is None for p in fsdp.parameters()):
            continue  # a void step (the group changed in it): it runs again
        moved = fsdp._elastic.last_move if fsdp._elastic is not None else None
        line: dict[str, Any] = {"step": step, "world": backend.world_size, "t": time.time()}
        if moved is not None and moved is not last_move:
            last_move = moved
            line["moved"] = moved
        print(json.dumps(line), flush=True)
        time.sleep(float(os.environ["PACE"]))
    backend.close()
    os._exit(0)


def bare_stream(nbytes: int) -> float:
    """Bytes per second of ``nbytes`` streamed by grpc.aio from one process
    to another (1 MiB messages, no framing, no checks)."""
    sys.path.insert(0, str(ROOT))
    from ferrogrpc.testing import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--sink", str(port), str(nbytes)],
        stdout=subprocess.PIPE,
    )
    try:
        asyncio.run(_send(port, nbytes))
        out, _ = server.communicate(timeout=300)
    finally:
        if server.poll() is None:
            server.kill()
    return float(out.decode().split()[-1])


OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


async def _send(port: int, nbytes: int) -> None:
    import grpc.aio

    chunk = b"\x01" * 2**20
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        await channel.channel_ready()
        call = channel.stream_unary("/bare/Sink")

        async def chunks() -> Any:
            for _ in range(nbytes // len(chunk)):
                yield chunk

        await call(chunks())


def sink(port: int, nbytes: int) -> None:
    import grpc
    import grpc.aio

    async def serve() -> None:
        rate: list[float] = []
        done = asyncio.Event()

        async def handler(requests: Any, context: Any) -> bytes:
            got, began = 0, 0.0
            async for message in requests:
                if not began:
                    began = time.perf_counter()
                got += len(message)
            rate.append(got / (time.perf_counter() - began))
            done.set()
            return b""

        server = grpc.aio.server(options=OPTIONS)
        method = grpc.stream_unary_rpc_method_handler(handler)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bare", {"Sink": method}),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await done.wait()
        await server.stop(None)
        print(rate[0], flush=True)

    asyncio.run(serve())


def lines(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> list[dict[str, Any]]:
    out = []
    for i, log in enumerate(logs):
        text = log.read_text(errors="replace")
        for raw in text[: text.rfind("\n") + 1].splitlines():
            if raw.startswith("{"):
                d = json.loads(raw)
                d["proc"] = i
                out.append(d)
    return out


def one(at: str, args: argparse.Namespace) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from ferrogrpc.testing import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "FERROGRPC_COORDINATOR": f"127.0.0.1:{port}",
            "FERROGRPC_SHM": "1" if args.shm else "0",
            "FERROGRPC_HEARTBEAT_TIMEOUT": str(args.heartbeat),
            "PARAMS": str(args.params),
            "STEPS": str(args.steps),
            "PACE": str(args.pace),
            "OUT_DIR": tmp,
        }
        coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(args.nproc)),
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            cwd=ROOT,
            env=env,
            stdout=(Path(tmp) / "coordinator.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []

        def start() -> None:
            log = Path(tmp) / f"rank{len(procs)}.log"
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker"],
                    cwd=ROOT,
                    env=env,
                    stdout=log.open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )

        def wait_for(what: Any, why: str) -> Any:
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                got = what()
                if got:
                    return got
                if coordinator.poll() is not None:
                    break
                time.sleep(0.05)
            tails = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
            raise SystemExit(f"{why}\n{tails}")

        try:
            for _ in range(args.nproc):
                start()
            wait_for(
                lambda: [d for d in lines(procs, logs) if d.get("step", -1) >= args.warmup],
                "no warm-up",
            )
            (Path(tmp) / "kill").write_text(at)
            kill = wait_for(
                lambda: [d for d in lines(procs, logs) if d.get("event") == "died"], "no kill"
            )[0]
            killed_at = max(
                d["step"] for d in lines(procs, logs) if d["proc"] == kill["proc"] and "step" in d
            )
            after = wait_for(
                lambda: [
                    d
                    for d in lines(procs, logs)
                    if d.get("step", -1) >= killed_at + 3 and d["world"] == args.nproc - 1
                ],
                "the survivors made no step",
            )
            assert after
            start()
            joined = wait_for(
                lambda: [
                    d for d in lines(procs, logs) if d["proc"] == len(procs) - 1 and "moved" in d
                ],
                "the joiner never trained",
            )[0]

            # Every member's account of the same re-shard (what each received).
            def members_moved() -> dict[int, dict[str, float]] | None:
                got = {
                    d["proc"]: d["moved"]
                    for d in lines(procs, logs)
                    if "moved" in d and d["world"] == args.nproc
                }
                return got if len(got) == args.nproc else None

            grown = wait_for(members_moved, "not every member re-sharded for the joiner")
            # (The rest of the run is not measured: it is stopped here.)
        finally:
            for p in [*procs, coordinator]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        got = lines(procs, logs)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in got:
        if "step" in d and "world" in d:
            by_step.setdefault(d["step"], []).append(d)
    ends = [max(d["t"] for d in by_step[s]) for s in range(1, killed_at + 1)]
    step = statistics.median(b - a for a, b in itertools.pairwise(ends))
    first = min(s for s, ds in by_step.items() if s > killed_at and ds[0]["world"] < args.nproc)
    recovered = max(d["t"] for d in by_step[first] if d["world"] < args.nproc)
    # The kill step itself is void (re-run over the survivors): the first
    # step they complete is that one.
    moved = joined["moved"]
    shrink = [d["moved"]["seconds"] for d in got if "moved" in d and d["world"] == args.nproc - 1]
    return {
        "reshard": max(shrink),
        "step": step,
        "recovery": recovered - kill["t"],
        "kill_step": float(killed_at + 1),
        "first": float(first),
        "joiner_bytes": moved["bytes"],
        "joiner_seconds": moved["seconds"],
        "joiner_arrival": moved["arrival"],
        "group_bytes": sum(m["bytes"] for m in grown.values()),
        "group_arrival": max(m["arrival"] for m in grown.values()),
    }


def main() -> int:
    if "--worker" in sys.argv:
        worker()
        return 0
    if "--sink" in sys.argv:
        i = sys.argv.index("--sink")
        sink(int(sys.argv[i + 1]), int(sys.argv[i + 2]))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=parse_count, default=25_000_000)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--pace", type=float, default=0.0, help="seconds each rank sleeps after a step"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=10.0,
        help="FERROGRPC_HEARTBEAT_TIMEOUT (10: two cores for five processes, nobody is "
        "taken for silent when busy)",
    )
    parser.add_argument(
        "--shm", action="store_true", help="the same-host shared-memory path (default: gRPC)"
    )
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        at = KILLS[i % len(KILLS)]
        r = one(at, args)
        bare = bare_stream(max(2**20, int(r["joiner_bytes"])))
        r["rate"] = r["joiner_bytes"] / r["joiner_seconds"]
        r["arriving"] = r["joiner_bytes"] / max(r["joiner_arrival"], 1e-9)
        r["bare"] = bare
        runs.append(r)
        print(
            f"run {i} (kill {at}, step {r['kill_step']:.0f}): step {r['step']:.2f}s, kill -> "
            f"survivors' next step {r['recovery']:.2f}s (step {r['first']:.0f}; its re-shard "
            f"{r['reshard']:.2f}s); joiner "
            f"received {r['joiner_bytes'] / 1e6:.1f} MB in a re-shard of "
            f"{r['joiner_seconds']:.2f}s ({r['rate'] / bare:.0%} of the bare stream), arriving "
            f"in {r['joiner_arrival']:.2f}s at {r['arriving'] / 1e6:.0f} MB/s; bare gRPC "
            f"stream {bare / 1e6:.0f} MB/s ({r['arriving'] / bare:.0%}); the whole group "
            f"received {r['group_bytes'] / 1e6:.0f} MB in {r['group_arrival']:.2f}s, "
            f"{r['group_bytes'] / r['group_arrival'] / bare:.0%} of the bare stream",
            flush=True,
        )
    over = [r["recovery"] - r["step"] for r in runs]
    share = [r["arriving"] / r["bare"] for r in runs]
    whole = [r["rate"] / r["bare"] for r in runs]
    print(
        f"kill -> next step minus one step: median {statistics.median(over):.2f}s "
        f"(runs {', '.join(f'{o:.2f}' for o in over)}; bar <= 1 s)"
    )
    print(
        f"joiner's shards arriving / bare stream: median {statistics.median(share):.0%} "
        f"(runs {', '.join(f'{s:.0%}' for s in share)}; bar >= 70%); the whole re-shard "
        f"(epoch set-up, plan, allocation) / bare: median {statistics.median(whole):.0%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
