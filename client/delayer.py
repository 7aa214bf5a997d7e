"""A network delayer in user space, for slow and lossy test links: this
kernel has tc's tbf and htb but no netem. Packets that a netfilter rule
sends to NFQUEUE (``-j NFQUEUE --queue-num N``) are held for ``--delay-ms``
and then let through, in order; with ``--drop-syns K``, the first K TCP SYNs
(connection attempts) are dropped instead. With ``--arm-file``, both start
only once that file exists (a job can start up on a fast link first).

Run it inside the network namespace whose rule queues the packets, with
:func:`delaying` (below) or as ``python -m client.delayer --queue N ...``.
It prints ``READY`` once bound, and on SIGTERM exits 0, reporting what it
did. Needs root, iptables (this kernel has the NFQUEUE target but not
nftables' own ``queue`` expression) and the NetfilterQueue package (built
against libnetfilter-queue-dev).

[Note: where the delay goes] A packet held on its sender's own way out
(the OUTPUT chain) still belongs to the sending socket, and TCP's small
queues (TSQ) let a socket hold only about a millisecond of its pacing rate
below it: a delay there caps a stream at that amount per delay, far below
the link. On its way in (INPUT), the packet has crossed the veth, which
frees it from its sender: hold it there. A link of round trip R is then
R/2 on each end's way in.

Every packet costs this process a Python callback and a verdict (a
netlink message), so it has a ceiling of its own, in packets per second:
``client.bench_link`` measures it before trusting a delayed link.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from client.common import ROOT, checkout_env

# Bytes of each packet copied to the delayer: enough for the IPv4 and TCP
# headers that is_syn reads, so that a full-size packet is not copied.
COPY_BYTES = 128


def is_syn(packet: bytes) -> bool:
    """Whether an IPv4 packet is a TCP SYN without ACK (a connection attempt)."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != 6:
        return False
    flags_at = (packet[0] & 0x0F) * 4 + 13
    return len(packet) > flags_at and packet[flags_at] & 0x12 == 0x02


def main(argv: list[str] | None = None) -> int:
    from netfilterqueue import COPY_PACKET, NetfilterQueue

    parser = argparse.ArgumentParser()
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--drop-syns", type=int, default=0)
    parser.add_argument("--arm-file", help="delay and drop only once this file exists")
    args = parser.parse_args(argv)
    delay = args.delay_ms / 1e3
    # Every packet waits the same delay, so release order is arrival order:
    # a FIFO of (release time, packet).
    held: collections.deque[tuple[float, Any]] = collections.deque()
    counts = {"delayed": 0, "dropped": 0}
    drops = [args.drop_syns]
    armed = [args.arm_file is None]

    def on_packet(pkt: Any) -> None:
        if not armed[0]:
            armed[0] = os.path.exists(args.arm_file)
            if not armed[0]:
                pkt.accept()
                return
        if drops[0] > 0 and is_syn(pkt.get_payload()):
            drops[0] -= 1
            counts["dropped"] += 1
            pkt.drop()
            return
        counts["delayed"] += 1
        held.append((time.monotonic() + delay, pkt))

    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    queue = NetfilterQueue()
    queue.bind(args.queue, on_packet, max_len=65536, mode=COPY_PACKET, range=COPY_BYTES)
    fd = queue.get_fd()
    print("READY", flush=True)
    try:
        while not stop[0]:
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
            wait = min(0.2, held[0][0] - now) if held else 0.2
            readable, _, _ = select.select([fd], [], [], max(0.0, wait))
            if readable:
                queue.run(block=False)
    finally:
        for _, pkt in held:
            pkt.accept()
        queue.unbind()
    print(f"delayed {counts['delayed']} dropped {counts['dropped']}", flush=True)
    return 0


@contextlib.contextmanager
def delaying(
    namespace: str,
    peer: str,
    *,
    delay_ms: float = 0.0,
    drop_syns: int = 0,
    arm_file: Path | None = None,
    queue: int = 0,
    incoming: bool = False,
) -> Iterator[subprocess.Popen[str]]:
    """In ``namespace``, hold every IPv4 packet it sends to ``peer`` (or,
    with ``incoming``, receives from ``peer``) for ``delay_ms``, and drop
    the first ``drop_syns`` SYNs, once ``arm_file`` exists if one is given:
    an iptables rule (OUTPUT, or INPUT) queues them to this delayer, run in
    that namespace. ``peer`` is an address or a network (``a.b.c.0/24``).
    For a delay that TCP's small queues do not cap, use ``incoming`` (see
    [Note: where the delay goes]). Removes both on exit."""
    # A host's packets to itself come in on lo: not over the link.
    match = ["INPUT", "!", "-i", "lo", "-s", peer] if incoming else ["OUTPUT", "-d", peer]
    rule = [*match, "-j", "NFQUEUE", "--queue-num", str(queue)]
    cmd = [sys.executable, "-m", "client.delayer", "--queue", str(queue)]
    cmd += ["--delay-ms", str(delay_ms), "--drop-syns", str(drop_syns)]
    if arm_file is not None:
        cmd += ["--arm-file", str(arm_file)]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, *cmd],
        stdout=subprocess.PIPE,
        text=True,
        env=checkout_env(),
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"the delayer did not start: {line!r}")
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
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
