"""Run the ferrogrpc coordinator: ``python -m server --world-size N --port P``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from ferrogrpc.coordinator import Coordinator


async def serve(
    world_size: int, host: str, port: int, min_ranks: int = 1, join_window: float = 5.0
) -> None:
    coordinator = Coordinator(world_size, min_ranks=min_ranks, join_window=join_window)
    bound = await coordinator.start(f"{host}:{port}")
    logging.getLogger("ferrogrpc.coordinator").info(
        "coordinator for world_size %d listening on %s:%d", world_size, host, bound
    )
    size = str(world_size) if world_size else f"decided by who joins (at least {min_ranks})"
    print(f"coordinator listening on {host}:{bound} (world_size {size})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("coordinator shutting down", flush=True)
    await coordinator.stop(grace=2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferrogrpc coordinator", description=__doc__)
    parser.add_argument(
        "--world-size",
        type=int,
        required=True,
        help="ranks to wait for; 0: release whoever joined once --join-window passes "
        "without a new peer (at least --min-ranks)",
    )
    parser.add_argument("--min-ranks", type=int, default=1)
    parser.add_argument("--join-window", type=float, default=5.0, help="seconds (elastic mode)")
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args.world_size, args.host, args.port, args.min_ranks, args.join_window))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
