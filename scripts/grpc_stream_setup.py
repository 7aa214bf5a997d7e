"""What a gRPC stream per collective costs over a long-lived stream, on this
machine (issue 31, item 5): two processes; the client moves the same
messages (two of ``--bytes`` each, then waits for the receiver's
acknowledgement) either on a new client-streaming RPC each time (what a
ring lane does today: ``Send``, one per collective and lane) or on one
long-lived bidirectional stream, with an empty message marking each
round's end and an empty reply acknowledging it.

    python scripts/grpc_stream_setup.py --rounds 300 --repeats 3

Prints the median round time of each, alternated ``--repeats`` times. No
tensors, no framing, no checks: the difference is the stream's own setup
and teardown (HEADERS, the server's call object and task, the trailers).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

SERVICE = "bench.Setup"


def _identity(data: bytes) -> bytes:
    return data


async def _serve(port: int) -> None:
    async def send(requests: AsyncIterator[bytes], context: Any) -> bytes:
        async for _ in requests:
            pass
        return b""

    async def lane(requests: AsyncIterator[bytes], context: Any) -> None:
        async for message in requests:
            if not message:
                await context.write(b"")

    server = grpc.aio.server()
    handlers = {
        "Send": grpc.stream_unary_rpc_method_handler(send),
        "Lane": grpc.stream_stream_rpc_method_handler(lane),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("READY", flush=True)
    await server.wait_for_termination()


async def _measure(port: int, rounds: int, repeats: int, nbytes: int) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await channel.channel_ready()
    message = b"x" * nbytes
    send = channel.stream_unary(
        f"/{SERVICE}/Send", request_serializer=_identity, response_deserializer=_identity
    )
    lane = channel.stream_stream(
        f"/{SERVICE}/Lane", request_serializer=_identity, response_deserializer=_identity
    )
    kept = lane()
    for repeat in range(repeats):
        per_rpc: list[float] = []
        for _ in range(rounds):
            start = time.perf_counter()
            call = send()
            await call.write(message)
            await call.write(message)
            await call.done_writing()
            await call
            per_rpc.append(time.perf_counter() - start)
        long_lived: list[float] = []
        for _ in range(rounds):
            start = time.perf_counter()
            await kept.write(message)
            await kept.write(message)
            await kept.write(b"")
            await kept.read()
            long_lived.append(time.perf_counter() - start)
        a = sorted(per_rpc)[rounds // 2] * 1e6
        b = sorted(long_lived)[rounds // 2] * 1e6
        print(
            f"repeat {repeat + 1}: a stream per round {a:.0f} us, one long-lived stream "
            f"{b:.0f} us (saves {a - b:.0f} us a round)",
            flush=True,
        )
    await kept.done_writing()
    await channel.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        asyncio.run(_measure(port, args.rounds, args.repeats, args.bytes))
    finally:
        server.kill()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
