"""The ``ferrogrpc`` command: demo, bench, launch, coordinator, health, status.

``coordinator``, ``health`` and ``status`` import no torch. ``demo`` and
``bench`` run the programs of a ferrogrpc checkout (``client/``), which
the README's install (``pip install -e``) provides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The checkout this package was installed from (an editable install), if any.
CHECKOUT = Path(__file__).resolve().parent.parent

# Subcommands that run a program of the checkout, and its module.
PROGRAMS = {"demo": "client.demo", "bench": "client.bench"}


def _status(target: str) -> int:
    from .control.coordinator_client import fetch_status
    from .env import Settings
    from .errors import ConfigError, RendezvousError

    try:
        s = Settings.from_env()  # FERROGRPC_TOKEN and FERROGRPC_TLS_*, as the coordinator's
        status = asyncio.run(fetch_status(target, token=s.token, tls=s.tls))
    except (ConfigError, RendezvousError) as exc:
        print(f"ferrogrpc status: {exc}", file=sys.stderr)
        return 1
    now = time.time()

    def age(last_heartbeat: float) -> str:
        return f"{max(0.0, now - last_heartbeat):.1f}s ago" if last_heartbeat else "never"

    if status.epoch:
        # An elastic group: its epoch's members, then the joiners waiting,
        # then the spares (beyond max_world_size).
        waiting, spares = len(status.joiners), len(status.spares)
        most = f" (max_world_size {status.max_world_size})" if status.max_world_size else ""
        print(
            f"coordinator {target}: elastic group, run {status.run_id}, epoch {status.epoch}: "
            f"{status.joined} members{most}, {waiting} joiner{'' if waiting == 1 else 's'} "
            f"waiting, {spares} spare{'' if spares == 1 else 's'}"
        )
        print(f"{'rank':>4}  {'address':<24} {'last heartbeat':>15}  state")
        for m in status.members:
            print(f"{m.rank:>4}  {m.address:<24} {age(m.last_heartbeat):>15}  member")
        for j in status.joiners:
            print(f"{'-':>4}  {j.address:<24} {age(j.last_heartbeat):>15}  joiner, waiting")
        for j in status.spares:
            print(f"{'-':>4}  {j.address:<24} {age(j.last_heartbeat):>15}  spare, ready")
    else:
        print(
            f"coordinator {target}: run {status.run_id}, {status.joined}/{status.world_size} joined"
        )
        if status.ended:
            print(f"the last elastic group ended: {status.ended}")
        print(f"{'rank':>4}  {'address':<24} {'last heartbeat':>15}  collective")
        for m in status.members:
            current = f"{m.collective}#{m.seq}" if m.collective else f"idle (last #{m.seq})"
            print(f"{m.rank:>4}  {m.address:<24} {age(m.last_heartbeat):>15}  {current}")
    if status.metrics_port:
        # The coordinator serves its group's metrics (--metrics-port): print them.
        from .control.group_metrics import describe

        host = target.rsplit(":", 1)[0]
        try:
            print(describe(f"http://{host}:{status.metrics_port}/metrics"))
        except OSError as exc:
            print(f"group metrics: not readable ({exc})")
    return 0


def _diagnose(directory: str, *, as_json: bool) -> int:
    """Print the diagnosis of every group's flight records in ``directory``:
    0 when a culprit is named, 1 when none is, 2 when there is nothing to
    read or a file is not a flight record (one line naming it and the
    field: observe/schema.py)."""
    from .observe.diagnose import diagnose_dir, render

    try:
        found = diagnose_dir(directory)
    except ValueError as exc:
        print(f"ferrogrpc diagnose: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([d.as_dict() for d in found], indent=1))
    else:
        print(render(found), end="")
    return 0 if found[-1].culprit is not None else 1


def _trace_merge(directory: str, output: str) -> int:
    """Merge the ranks' traces in ``directory`` into ``output``: 0, or 2
    when there is nothing to merge, a file is not a trace (one line naming
    it and the field: observe/schema.py), or ``output`` cannot be written."""
    from .observe.trace import merge

    try:
        merged = merge(directory, output)
    except (ValueError, OSError) as exc:
        print(f"ferrogrpc trace merge: {exc}", file=sys.stderr)
        return 2
    for file in merged["files"]:
        clock = file.get("clock")
        aligned = "not aligned (no clock offset measured)"
        if clock is not None:
            offset, bound = clock["offset_s"] * 1e3, clock["error_bound_s"] * 1e3
            aligned = f"clock offset {offset:+.3f} ms (within {bound:.3f} ms)"
        print(f"rank {file['rank']}: {file['file']}, {file['events']} events, {aligned}")
    print(f"wrote {output}: ranks {merged['ranks']}, on rank 0's clock")
    return 0


def _program(command: str, argv: list[str]) -> int:
    """Run ``client/``'s program for ``command`` in a child process, with
    this checkout first on its path."""
    module = PROGRAMS[command]
    if not (CHECKOUT / "client" / "__init__.py").is_file():
        print(
            f"ferrogrpc {command} runs {module.replace('.', '/')}.py of a ferrogrpc checkout; "
            f"none is installed here ({CHECKOUT}). Clone the repository and install it with "
            "pip install -e, as the README does.",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, "-m", module, *argv], env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ferrogrpc",
        description="DDP and FSDP training over asyncio gRPC ring collectives.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train locally with DDP and FSDP, check equivalence, plot")
    sub.add_parser("bench", help="all_reduce benchmark against gloo (ferrogrpc bench --help)")
    sub.add_parser("coordinator", help="run the rendezvous coordinator (--help for options)")
    sub.add_parser("health", help="exit 0 if the coordinator at HOST:PORT is serving")
    trace_p = sub.add_parser("trace", help="the ranks' traces (FERROGRPC_TRACE=DIR)")
    trace_sub = trace_p.add_subparsers(dest="trace_command", required=True)
    merge_p = trace_sub.add_parser(
        "merge", help="merge every rank's trace in DIR into one, on rank 0's clock"
    )
    merge_p.add_argument("directory", metavar="DIR")
    merge_p.add_argument("-o", "--output", default="run.json", help="(default run.json)")
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
    diagnose_p = sub.add_parser(
        "diagnose", help="name the culprit from the ranks' flight records (FERROGRPC_FLIGHT_DIR)"
    )
    diagnose_p.add_argument("directory", metavar="DIR")
    diagnose_p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    if argv and argv[0] in PROGRAMS:
        return _program(argv[0], argv[1:])
    if argv and argv[0] == "coordinator":
        from .control.serve import main as coordinator_main

        return coordinator_main(argv[1:])
    if argv and argv[0] == "health":
        from .control.health import main as health_main

        return health_main(argv[1:])
    ns = parser.parse_args(argv)
    if ns.command == "trace":
        return _trace_merge(ns.directory, ns.output)
    if ns.command == "status":
        return _status(ns.target)
    if ns.command == "diagnose":
        return _diagnose(ns.directory, as_json=ns.json)
    if ns.nproc < 1:
        # One line, as argparse's own errors end: no traceback from launch().
        print(f"ferrogrpc launch: --nproc must be 1 or more, got {ns.nproc}", file=sys.stderr)
        return 2
    from .control.launch import launch

    argv_ranks = [sys.executable, *(["-m"] if ns.module else []), ns.script, *ns.args]
    return launch(ns.nproc, argv_ranks, master_port=ns.master_port)


if __name__ == "__main__":
    raise SystemExit(main())
