"""The latency floor of a small exchange over gRPC on this machine: two
processes, each with a server and a long-lived client stream to the other,
exchange 4-byte messages the way a world-2 all-reduce does (each sends one,
then waits for the other's). No tensors, no framing, no checks: what
ferrogrpc's gRPC path could reach if all of its own work were free.

    python scripts/grpc_latency_floor.py --mode aio       # on the event loop's own task
    python scripts/grpc_latency_floor.py --mode handoff   # started from another thread
    python scripts/grpc_latency_floor.py --mode sync      # grpc's sync stack, no event loop
    python scripts/grpc_latency_floor.py --mode subscribe # the caller reads pushes itself
    python scripts/grpc_latency_floor.py --mode bare      # the hand-off alone: no gRPC at all

``subscribe``: each process's caller holds a sync server-streaming call to
the other's grpc.aio server and reads it in its own thread (no hand-off on
the way in); its own message goes to the loop, which pushes it down the
other's call. ``--gap-ms`` sleeps between exchanges, so that every thread
has gone to sleep when one starts (as in the bench, where each call follows
a gloo barrier); the median exchange is then printed too.

Prints wall and process CPU time per exchange for each process.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio

WARMUP = 200


def _ident(data: bytes) -> bytes:
    return data


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _report(mode: str, rank: int, n: int, wall: float, cpu: float) -> None:
    print(f"{mode} rank {rank}: {wall / n * 1e6:.0f} us, CPU {cpu / n * 1e6:.0f} us per exchange")


def _timed(mode: str, rank: int, n: int, gap: float, exchange: Any) -> None:
    """Run ``exchange()`` n times after the warm-up and report; with a gap,
    sleep before each and report the median exchange (the sleeps excluded)."""
    for _ in range(WARMUP):
        exchange()
    times = []
    t0, c0 = time.perf_counter(), _cpu()
    for _ in range(n):
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        exchange()
        times.append(time.perf_counter() - start)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    if not gap:
        _report(mode, rank, n, wall, cpu)
        return
    median = sorted(times)[n // 2]
    print(
        f"{mode} rank {rank}, {gap * 1e3:g} ms apart: median {median * 1e6:.0f} us, "
        f"CPU {cpu / n * 1e6:.0f} us per exchange"
    )


def _handlers(handler: Any) -> list[grpc.GenericRpcHandler]:
    method = grpc.stream_unary_rpc_method_handler(handler, _ident, _ident)
    return [grpc.method_handlers_generic_handler("floor.S", {"Send": method})]


def _aio(mode: str, rank: int, me: int, other: int, n: int, gap: float) -> None:
    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {}

    async def setup() -> None:
        box: asyncio.Queue[bytes] = asyncio.Queue()
        pushes: asyncio.Queue[bytes] = asyncio.Queue()

        async def send(it: Any, _ctx: Any) -> bytes:
            async for message in it:
                box.put_nowait(message)
            return b""

        async def subscribe(_request: bytes, _ctx: Any) -> Any:
            while True:
                yield await pushes.get()

        server = grpc.aio.server()
        server.add_generic_rpc_handlers(_handlers(send))
        sub = grpc.unary_stream_rpc_method_handler(subscribe, _ident, _ident)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("floor.P", {"Subscribe": sub})]
        )
        server.add_insecure_port(f"127.0.0.1:{me}")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{other}")
        stub = channel.stream_unary("/floor.S/Send", _ident, _ident)
        state.update(box=box, pushes=pushes, call=stub(wait_for_ready=True), server=server)

    async def exchange() -> None:
        await state["call"].write(b"abcd")
        await state["box"].get()

    async def run_here() -> tuple[float, float]:
        await setup()
        for _ in range(WARMUP):
            await exchange()
        t0, c0 = time.perf_counter(), _cpu()
        for _ in range(n):
            await exchange()
        return time.perf_counter() - t0, _cpu() - c0

    if mode == "aio":
        if gap:
            raise SystemExit("--gap-ms needs a caller thread: not with --mode aio")
        wall, cpu = loop.run_until_complete(run_here())
        _report(mode, rank, n, wall, cpu)
    else:  # the loop runs in its own thread; this one hands each exchange over
        threading.Thread(target=loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(setup(), loop).result()
        if mode == "handoff":
            _timed(
                mode,
                rank,
                n,
                gap,
                lambda: asyncio.run_coroutine_threadsafe(exchange(), loop).result(),
            )
        else:  # subscribe
            channel = grpc.insecure_channel(f"127.0.0.1:{other}")
            incoming = channel.unary_stream("/floor.P/Subscribe", _ident, _ident)(
                b"", wait_for_ready=True
            )
            pushes = state["pushes"]

            def push_and_read() -> None:
                loop.call_soon_threadsafe(pushes.put_nowait, b"abcd")
                next(incoming)

            _timed(mode, rank, n, gap, push_and_read)
    time.sleep(0.5)  # let the other finish its last exchange


def _sync(rank: int, me: int, other: int, n: int, gap: float) -> None:
    requests: queue.Queue[Any] = queue.Queue()
    done = threading.Event()

    def send(it: Any, _ctx: Any) -> bytes:
        requests.put(it)  # the caller reads this stream's iterator itself
        done.wait()
        return b""

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers(_handlers(send))
    server.add_insecure_port(f"127.0.0.1:{me}")
    server.start()
    outgoing: queue.Queue[bytes | None] = queue.Queue()

    def messages() -> Iterator[bytes]:
        while (message := outgoing.get()) is not None:
            yield message

    channel = grpc.insecure_channel(f"127.0.0.1:{other}")
    stub = channel.stream_unary("/floor.S/Send", _ident, _ident)
    call = stub.future(messages(), wait_for_ready=True)  # kept: collected, it would cancel
    incoming = requests.get()

    def exchange() -> None:
        outgoing.put(b"abcd")
        next(incoming)

    _timed("sync", rank, n, gap, exchange)
    time.sleep(0.5)
    outgoing.put(None)
    done.set()
    call.cancel()
    server.stop(0.1)


def _bare(n: int) -> None:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def nothing() -> None:
        pass

    t0, c0 = time.perf_counter(), _cpu()
    for _ in range(n):
        asyncio.run_coroutine_threadsafe(nothing(), loop).result()
    _report("bare", 0, n, time.perf_counter() - t0, _cpu() - c0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    modes = ("aio", "handoff", "sync", "subscribe", "bare")
    parser.add_argument("--mode", choices=modes, default="aio")
    parser.add_argument("--exchanges", type=int, default=3000)
    parser.add_argument("--gap-ms", type=float, default=0.0, help="sleep between exchanges")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.exchanges < 1:
        parser.error("--exchanges must be at least 1")
    if args.gap_ms < 0:
        parser.error("--gap-ms must not be negative")
    if args.mode == "bare":
        _bare(args.exchanges)
        return 0
    if args.rank is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from ferrogrpc.testing import free_port

        ports = f"{free_port()},{free_port()}"
        cmd = [sys.executable, __file__, "--mode", args.mode, "--exchanges", str(args.exchanges)]
        cmd += ["--gap-ms", str(args.gap_ms)]
        procs = [subprocess.Popen([*cmd, "--rank", str(r), "--ports", ports]) for r in (0, 1)]
        return max(p.wait(timeout=300) for p in procs)
    ports = [int(p) for p in args.ports.split(",")]
    me, other = ports[args.rank], ports[1 - args.rank]
    gap = args.gap_ms / 1e3
    if args.mode == "sync":
        _sync(args.rank, me, other, args.exchanges, gap)
    else:
        _aio(args.mode, args.rank, me, other, args.exchanges, gap)
    os._exit(0)  # grpc's threads may linger: this process has said what it measured


if __name__ == "__main__":
    sys.exit(main())
