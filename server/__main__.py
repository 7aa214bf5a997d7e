"""Run the ferrogrpc coordinator: ``python -m server --world-size N --port P``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from ferrogrpc.coordinator import Coordinator


async def serve(world_size: int, host: str, port: int) -> None:
    coordinator = Coordinator(world_size)
    bound = await coordinator.start(f"{host}:{port}")
    logging.getLogger("ferrogrpc.coordinator").info(
        "coordinator for world_size %d listening on %s:%d", world_size, host, bound
    )
    print(f"coordinator listening on {host}:{bound} (world_size {world_size})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("coordinator shutting down", flush=True)
    await coordinator.stop(grace=2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferrogrpc coordinator", description=__doc__)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args.world_size, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
