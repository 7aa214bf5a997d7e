"""A network delayer in user space, for tests of slow and lossy links: this
kernel has tc's tbf and htb but no netem. Packets that a netfilter rule
sends to NFQUEUE (``-j NFQUEUE --queue-num N``) are held for ``--delay-ms`` and then let
through, in order; with ``--drop-syns K``, the first K TCP SYNs (connection
attempts) are dropped instead. With ``--arm-file``, both start only once
that file exists (a job can start up on a fast link first).

Run it inside the network namespace whose rule queues the packets, with
:func:`delaying` (below) or as ``python tests/delayer.py --queue N ...``. It
prints ``READY`` once bound, and on SIGTERM exits 0, reporting what it did.
Needs root, iptables (this kernel has the NFQUEUE target but not nftables'
own ``queue`` expression) and the NetfilterQueue package (built against
libnetfilter-queue-dev).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def is_syn(packet: bytes) -> bool:
    """Whether an IPv4 packet is a TCP SYN without ACK (a connection attempt)."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != 6:
        return False
    flags_at = (packet[0] & 0x0F) * 4 + 13
    return len(packet) > flags_at and packet[flags_at] & 0x12 == 0x02


def main() -> int:
    from netfilterqueue import NetfilterQueue

    parser = argparse.ArgumentParser()
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--drop-syns", type=int, default=0)
    parser.add_argument("--arm-file", help="delay and drop only once this file exists")
    args = parser.parse_args()
    delay = args.delay_ms / 1e3
    held: list[tuple[float, int, Any]] = []
    order = itertools.count()
    counts = {"delayed": 0, "dropped": 0}
    drops = [args.drop_syns]

    def armed() -> bool:
        return args.arm_file is None or os.path.exists(args.arm_file)

    def on_packet(pkt: Any) -> None:
        if not armed():
            pkt.accept()
            return
        if drops[0] > 0 and is_syn(pkt.get_payload()):
            drops[0] -= 1
            counts["dropped"] += 1
            pkt.drop()
            return
        counts["delayed"] += 1
        heapq.heappush(held, (time.monotonic() + delay, next(order), pkt))

    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    queue = NetfilterQueue()
    queue.bind(args.queue, on_packet, max_len=65536)
    fd = queue.get_fd()
    print("READY", flush=True)
    try:
        while not stop[0]:
            now = time.monotonic()
            while held and held[0][0] <= now:
                heapq.heappop(held)[2].accept()
            wait = min(0.2, held[0][0] - now) if held else 0.2
            readable, _, _ = select.select([fd], [], [], max(0.0, wait))
            if readable:
                queue.run(block=False)
    finally:
        for _, _, pkt in held:
            pkt.accept()
        queue.unbind()
    print(f"delayed {counts['delayed']} dropped {counts['dropped']}", flush=True)
    return 0


@contextlib.contextmanager
def delaying(
    namespace: str,
    daddr: str,
    *,
    delay_ms: float = 0.0,
    drop_syns: int = 0,
    arm_file: Path | None = None,
    queue: int = 0,
) -> Iterator[subprocess.Popen[str]]:
    """In ``namespace``, hold every IPv4 packet it sends to ``daddr`` for
    ``delay_ms`` (and drop the first ``drop_syns`` SYNs), once ``arm_file``
    exists if one is given: an iptables output rule queues them to this delayer, run in
    that namespace. Removes both on exit."""
    rule = ["OUTPUT", "-d", daddr, "-j", "NFQUEUE", "--queue-num", str(queue)]
    cmd = [sys.executable, __file__, "--queue", str(queue), "--delay-ms", str(delay_ms)]
    cmd += ["--drop-syns", str(drop_syns)]
    if arm_file is not None:
        cmd += ["--arm-file", str(arm_file)]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, *cmd], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", f"the delayer did not start: {line!r}"
        subprocess.run(["ip", "netns", "exec", namespace, "iptables", "-A", *rule], check=True)
        yield proc
    finally:
        subprocess.run(
            ["ip", "netns", "exec", namespace, "iptables", "-D", *rule],
            capture_output=True,
            check=False,
        )
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
