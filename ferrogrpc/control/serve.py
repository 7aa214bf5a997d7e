"""``ferrogrpc coordinator``: run the rendezvous coordinator as a program,
``--world-size N --port P``.

It honours ``FERROGRPC_TOKEN`` and ``FERROGRPC_TLS_*`` as peers do (every
call must carry the token; every connection is mutual TLS), and
``FERROGRPC_MAX_RANKS`` (the most ranks a round sized by who joins, or an
elastic epoch, takes) and ``FERROGRPC_MAX_WORLD_SIZE`` (an elastic group's
most members: the others wait as hot spares). It imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import logging.handlers
import queue
import signal
import sys
import threading

from ..env import Settings
from ..errors import ConfigError
from .coordinator import Coordinator, Limits
from .group_metrics import GroupMetricsServer

# With --exit-when-done: a rank of the run that sent no heartbeat for this
# long (three heartbeat periods) has left, crashed or been killed.
RUN_SILENT_S = 6.0

# Log records waiting for the writer thread; beyond this many, new ones are
# dropped (and counted) rather than making the server wait.
LOG_QUEUE = 10_000


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Hands records to the writer thread without ever blocking: a full
    queue (stderr not being read) drops the record."""

    dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            _DroppingQueueHandler.dropped += 1


class LogWriter:
    """Every log record goes through a bounded queue to a daemon thread that
    writes stderr: the event loop never waits on a slow or full stderr.
    ``close()`` lets the thread finish what is queued, for up to 2 s."""

    def __init__(self, level: int = logging.INFO) -> None:
        self._records: queue.Queue[logging.LogRecord | None] = queue.Queue(LOG_QUEUE)
        self._writer = logging.StreamHandler(sys.stderr)
        self._writer.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        root = logging.getLogger()
        root.handlers[:] = [_DroppingQueueHandler(self._records)]
        root.setLevel(level)
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (record := self._records.get()) is not None:
            self._writer.handle(record)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._records.put_nowait(None)
        self._thread.join(timeout=2.0)


async def serve(
    world_size: int,
    host: str,
    port: int,
    min_ranks: int = 1,
    join_window: float = 5.0,
    settings: Settings | None = None,
    exit_when_done: bool = False,
    metrics_port: int | None = None,
    max_world_size: int | None = None,
) -> None:
    s = settings or Settings.from_env()
    coordinator = Coordinator(
        world_size,
        min_ranks=min_ranks,
        join_window=join_window,
        token=s.token,
        tls=s.tls,
        limits=Limits(max_ranks=s.max_ranks),
        heartbeat_timeout=s.heartbeat_timeout,
        max_world_size=max_world_size if max_world_size is not None else s.max_world_size,
    )
    bound = await coordinator.start(f"{host}:{port}")
    logging.getLogger("ferrogrpc.coordinator").info(
        "coordinator for world_size %d listening on %s:%d", world_size, host, bound
    )
    size = str(world_size) if world_size else f"decided by who joins (at least {min_ranks})"
    secured = ", token required" if s.token else ""
    secured += ", mutual TLS" if s.tls else ""
    print(f"coordinator listening on {host}:{bound} (world_size {size}{secured})", flush=True)
    metrics: GroupMetricsServer | None = None
    if metrics_port is not None:
        metrics = GroupMetricsServer(coordinator, host, metrics_port)
        print(f"group metrics on http://{host}:{metrics.port}/metrics", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if exit_when_done:

        async def watch_run() -> None:
            # A poll: silence is noticed by time passing, not by an event.
            while not coordinator.run_over(silent_s=RUN_SILENT_S):  # noqa: ASYNC110
                await asyncio.sleep(0.5)
            print("every rank of the run has left", flush=True)
            stop.set()

        watcher = asyncio.ensure_future(watch_run())
    await stop.wait()
    if exit_when_done:
        watcher.cancel()
    print("coordinator shutting down", flush=True)
    if metrics is not None:
        metrics.stop()
    await coordinator.stop(grace=2.0)


def build_parser() -> argparse.ArgumentParser:
    """``ferrogrpc coordinator``'s arguments."""
    parser = argparse.ArgumentParser(prog="ferrogrpc coordinator", description=__doc__)
    parser.add_argument(
        "--world-size",
        type=int,
        required=True,
        help="ranks to wait for; 0: release whoever joined once --join-window passes "
        "without a new peer (at least --min-ranks). An elastic group's first epoch is "
        "the first N to enter; later ones join it at its first step boundary",
    )
    parser.add_argument(
        "--min-ranks",
        type=int,
        default=1,
        help="with --world-size 0, the fewest ranks released together; an elastic group "
        "(FERROGRPC_ELASTIC=1) forms its first epoch with at least this many and never "
        "goes on with fewer (default 1)",
    )
    parser.add_argument(
        "--join-window",
        type=float,
        default=5.0,
        help="with --world-size 0, the seconds without a new rank after which those that "
        "joined are released; an elastic group's first epoch forms after it too (default 5)",
    )
    parser.add_argument(
        "--max-world-size",
        type=int,
        default=None,
        help="an elastic group's most members (FERROGRPC_MAX_WORLD_SIZE; default: the "
        "members' own, else no limit): processes beyond it wait as hot spares, admitted at "
        "the first step boundary after a member is lost",
    )
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=29400, help="(default 29400)")
    parser.add_argument(
        "--exit-when-done",
        action="store_true",
        help="exit once a run was released and every rank of it has left (or gone silent for "
        f"{RUN_SILENT_S:g}s): `docker-compose up` then returns when training ends",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the group's Prometheus metrics on this port (0: an ephemeral one; default "
        "off); `ferrogrpc status` prints them",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"ferrogrpc coordinator: {exc}", file=sys.stderr)
        return 2
    logs = LogWriter()
    try:
        asyncio.run(
            serve(
                args.world_size,
                args.host,
                args.port,
                args.min_ranks,
                args.join_window,
                settings,
                exit_when_done=args.exit_when_done,
                metrics_port=args.metrics_port,
                max_world_size=args.max_world_size,
            )
        )
    finally:
        logs.close()
    return 0
