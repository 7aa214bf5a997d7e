"""The ``ferrogrpc`` command: demo, bench, launch, coordinator, status."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time


def _status(target: str) -> int:
    from .control.coordinator import fetch_status
    from .errors import ConfigError, RendezvousError
    from .runtime.settings import Settings

    try:
        s = Settings.from_env()  # FERROGRPC_TOKEN and FERROGRPC_TLS_*, as the coordinator's
        status = asyncio.run(fetch_status(target, token=s.token, tls=s.tls))
    except (ConfigError, RendezvousError) as exc:
        print(f"ferrogrpc status: {exc}", file=sys.stderr)
        return 1
    print(f"coordinator {target}: run {status.run_id}, {status.joined}/{status.world_size} joined")
    print(f"{'rank':>4}  {'address':<24} {'last heartbeat':>15}  collective")
    now = time.time()
    for m in status.members:
        age = f"{now - m.last_heartbeat:.1f}s ago" if m.last_heartbeat else "never"
        current = f"{m.collective}#{m.seq}" if m.collective else f"idle (last #{m.seq})"
        print(f"{m.rank:>4}  {m.address:<24} {age:>15}  {current}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ferrogrpc",
        description="DDP and FSDP training over asyncio gRPC ring collectives.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train locally with DDP and FSDP, check equivalence, plot")
    sub.add_parser("bench", help="all_reduce benchmark against gloo (ferrogrpc bench --help)")
    sub.add_parser("coordinator", help="run the rendezvous coordinator")
    launch_p = sub.add_parser("launch", help="run N local ranks of a script, torchrun-style")
    launch_p.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    launch_p.add_argument(
        "--master-port", type=int, default=None, help="TCPStore port (default: a free one)"
    )
    launch_p.add_argument("-m", dest="module", action="store_true", help="run script as a module")
    launch_p.add_argument("script", help="the program every rank runs")
    launch_p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    status_p = sub.add_parser("status", help="print a coordinator's member table")
    status_p.add_argument("target", metavar="HOST:PORT")
    if argv and argv[0] in ("demo", "bench", "coordinator"):
        command, rest = argv[0], argv[1:]
        if command == "demo":
            from client.demo import main as demo_main

            return demo_main(rest)
        if command == "bench":
            from client.bench import main as bench_main

            return bench_main(rest)
        from server.__main__ import main as coordinator_main

        return coordinator_main(rest)
    ns = parser.parse_args(argv)
    if ns.command == "status":
        return _status(ns.target)
    from .control.launch import launch

    argv_ranks = [sys.executable, *(["-m"] if ns.module else []), ns.script, *ns.args]
    return launch(ns.nproc, argv_ranks, master_port=ns.master_port)


if __name__ == "__main__":
    raise SystemExit(main())
