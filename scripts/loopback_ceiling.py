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
import socket
import statistics
import time
from multiprocessing.connection import Connection

BLOCK = 4 << 20


def _send(sock: socket.socket, total: int) -> None:
    buf = memoryview(bytearray(BLOCK))
    left = total
    while left:
        n = min(left, BLOCK)
        sock.sendall(buf[:n])
        left -= n


def _recv(sock: socket.socket, total: int) -> None:
    buf = memoryview(bytearray(BLOCK))
    left = total
    while left:
        got = sock.recv_into(buf, min(left, BLOCK))
        if not got:
            raise ConnectionError("peer closed early")
        left -= got


def _peer(port: int, total: int, iters: int, both: bool, done: Connection) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    for _ in range(iters):
        if both:
            _duplex(sock, total)
        else:
            _recv(sock, total)
        sock.sendall(b"k")
    sock.close()
    done.send(True)


def _duplex(sock: socket.socket, total: int) -> None:
    import threading

    sender = threading.Thread(target=_send, args=(sock, total))
    sender.start()
    _recv(sock, total)
    sender.join()


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
        if both:
            _duplex(sock, total)
        else:
            _send(sock, total)
        _recv(sock, 1)
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
