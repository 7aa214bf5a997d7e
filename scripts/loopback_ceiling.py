"""The loopback TCP ceiling of this machine: one process streams bytes to
another over a 127.0.0.1 socket (``sendall`` of a preallocated buffer,
``recv_into`` a preallocated buffer: no Python copies, only the kernel's),
one direction, and then both directions at once (as a ring's ranks do).
Reports GB/s per direction, median of several transfers.

    python scripts/loopback_ceiling.py --mib 256 --iters 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from client.netlab import exchange, recv_bytes


def _peer(port: int, total: int, iters: int, both: bool, done: Connection) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    for _ in range(iters):
        exchange(sock, total, send=both, recv=True)
        sock.sendall(b"k")
    sock.close()
    done.send(True)


def measure(mib: int, iters: int, both: bool) -> float:
    total = mib << 20
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.Process(target=_peer, args=(port, total, iters, both, child))
    proc.start()
    sock, _ = listener.accept()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        exchange(sock, total, send=True, recv=both)
        recv_bytes(sock, 1)
        times.append(time.perf_counter() - start)
    parent.recv()
    proc.join()
    sock.close()
    listener.close()
    return total / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    one = measure(args.mib, args.iters, both=False)
    two = measure(args.mib, args.iters, both=True)
    print(
        f"loopback TCP, {args.mib} MiB, median of {args.iters}: one direction {one:.2f} GB/s; "
        f"both directions at once {two:.2f} GB/s each way"
    )


if __name__ == "__main__":
    main()
