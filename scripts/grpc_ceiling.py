"""The gRPC ceiling on this machine: raw bytes streamed around a ring of
processes with grpc.aio, no tensors, no framing, no checks. What ferrogrpc's
all_reduce could reach if all of its own work were free.

On a machine where the ranks share too few cores the CPU time is the bound,
so it also prints each rank's CPU milliseconds per MB sent (and received):
compare it with a collective's CPU time per MB it moves.

    python scripts/grpc_ceiling.py --world-size 4 --mib 200 --chunk-kib 4096
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import grpc
import grpc.aio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


async def rank_main(
    rank: int, world: int, base: int, count: int, size: int, start_at: float
) -> tuple[float, float]:
    import ferrogrpc as fg

    # The same allocator settings a ferrogrpc rank runs with.
    fg.testing.tune_allocator(True, cap_arenas=True)
    done = asyncio.Event()

    async def handler(requests: object, context: object) -> bytes:
        async for _ in requests:  # type: ignore[attr-defined]
            pass
        done.set()
        return b""

    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "ring", {"S": grpc.stream_unary_rpc_method_handler(handler)}
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{base + rank}")
    await server.start()
    # Every rank starts at the same moment, so all of them stream all along.
    await asyncio.sleep(max(0.0, start_at - time.time()))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{base + (rank + 1) % world}", options=OPTIONS)
    method = channel.stream_unary("/ring/S", request_serializer=bytes, response_deserializer=bytes)
    # grpc-stubs wants a request iterator; grpc.aio also takes writes.
    call = method(wait_for_ready=True)  # type: ignore[call-arg]
    message = os.urandom(size)
    cpu = time.process_time()
    start = time.perf_counter()
    for _ in range(count):
        await call.write(message)
    await call.done_writing()
    await call
    await done.wait()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    await channel.close(None)
    # With a grace: the left neighbour may still be waiting for the answer
    # to its stream (the handler has returned; the answer may not have
    # left), and stop(0) would cancel it ("Cancelling all calls").
    await server.stop(5.0)
    return count * size / elapsed / 1e9, cpu * 1e3 / (count * size / 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mib", type=int, default=200, help="MiB each rank sends")
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument(
        "--start-delay", type=float, default=8.0, help="seconds for the ranks to start"
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--base", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.chunk_kib * 1024
    count = args.mib * 1024 // args.chunk_kib
    if args.rank is not None:
        gbps, cpu_ms_per_mb = asyncio.run(
            rank_main(args.rank, args.world_size, args.base, count, size, args.start_at)
        )
        print(f"{gbps:.3f} {cpu_ms_per_mb:.3f}", flush=True)
        return 0
    import random

    base = random.randint(20000, 40000)
    # Time enough for every rank to import and listen.
    start_at = time.time() + args.start_delay
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--world-size",
                str(args.world_size),
                "--mib",
                str(args.mib),
                "--chunk-kib",
                str(args.chunk_kib),
                "--rank",
                str(r),
                "--base",
                str(base),
                "--start-at",
                str(start_at),
            ],
            stdout=subprocess.PIPE,
            env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
            text=True,
        )
        for r in range(args.world_size)
    ]
    outputs = [p.communicate()[0].split() for p in procs]
    if any(p.returncode != 0 or len(out) != 2 for p, out in zip(procs, outputs, strict=True)):
        raise SystemExit("a rank failed (its error is above)")
    rates = sorted(float(out[0]) for out in outputs)
    cpus = sorted(float(out[1]) for out in outputs)
    print(
        f"raw grpc.aio ring, world {args.world_size}, {args.chunk_kib} KiB messages: "
        f"{rates[0]:.3f}-{rates[-1]:.3f} GB/s each way per rank; CPU per MB each way "
        f"{cpus[0]:.2f}-{cpus[-1]:.2f} ms (median {statistics.median(cpus):.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
