"""A test bed of hosts on a shared link: one network namespace per host, each
joined by a veth pair to a bridge in a hub namespace, optionally shaped to
a rate (tc tbf, both ways) and a round trip (the NFQUEUE delayer,
client/delayer.py: this kernel has no netem). Needs root and ``ip``, ``tc``
and, for a delay, iptables.

The tests' multi-host cases and ``ferrogrpc bench --link`` both build on
it. Run a stream between two hosts, the link's own ceiling, with
``python -m client.netlab stream ...`` inside their namespaces (see
:func:`stream_ceiling`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from client.common import ROOT as ROOT
from client.common import checkout_env
from client.delayer import delaying

# Addresses in 198.18.0.0/24, the range reserved for network tests, which
# live only inside the namespaces.
SUBNET = "198.18.0"

# How much a shaped link queues before it drops: a switch port's buffer.
QUEUE_S = 0.02

# Rates in bits per second, as tc spells them.
_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {proc.stderr.strip()}")


@dataclasses.dataclass(frozen=True)
class Link:
    """What each host's own link to the bridge is: ``rate`` bits per second
    each way (0: unshaped) and a round trip of ``rtt`` seconds between any
    two hosts (0: none added)."""

    rate: int = 0
    rtt: float = 0.0

    def __post_init__(self) -> None:
        if self.rate < 0 or self.rtt < 0:
            raise ValueError(f"a link's rate and round trip must be positive: {self}")

    @classmethod
    def parse(cls, text: str) -> Link:
        """``RATE[,RTT]``: ``1gbit``, ``100mbit,50ms`` (tc's spelling:
        kbit, mbit, gbit; the round trip in ms or s)."""
        rate_text, _, rtt_text = text.lower().replace(" ", "").partition(",")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(?:bit|bps)?", rate_text)
        if not m:
            raise ValueError(f"a link's rate is like 1gbit or 100mbit, got {rate_text!r}")
        rate = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
        rtt = 0.0
        if rtt_text:
            m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s)", rtt_text)
            if not m:
                raise ValueError(f"a link's round trip is like 50ms, got {rtt_text!r}")
            rtt = float(m.group(1)) / (1e3 if m.group(2) == "ms" else 1.0)
        return cls(rate, rtt)

    def __str__(self) -> str:
        rate = (
            f"{self.rate / 1e9:g} Gbit/s" if self.rate >= 10**9 else f"{self.rate / 1e6:g} Mbit/s"
        )
        return rate + (f", {self.rtt * 1e3:g} ms round trip" if self.rtt else "")


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of a :class:`Network`: its namespace, its address, and its
    veth pair: ``device`` inside the namespace, ``port`` on the bridge."""

    name: str
    namespace: str
    address: str
    device: str
    port: str

    def run(self, *argv: str) -> list[str]:
        """``argv`` as ``ip netns exec`` runs it in this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def tx_bytes(device: str | None = None) -> int:
    """Bytes this process's network namespace has sent on ``device``, or on
    all its devices but loopback: its link's counters (``ip netns exec``
    shows the namespace's own /sys/class/net). TSO hands a device segments
    of up to 64 KiB, so headers count once per segment, not per frame."""
    total = 0
    for dev in [device] if device else os.listdir("/sys/class/net"):
        if dev != "lo":
            with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
                total += int(f.read())
    return total


@dataclasses.dataclass(frozen=True)
class Network:
    """Hosts on one bridge (in the ``hub`` namespace), by name, in order."""

    hub: str
    hosts: dict[str, Host]


@contextlib.contextmanager
def network(
    names: Sequence[str], link: Link | None = None, segment: int | None = None
) -> Iterator[Network]:
    """One namespace per name, each with an address on a shared bridge
    (``SUBNET``.10, .11, ... in order) and a hosts file naming them all,
    its link shaped to ``link`` if given (:func:`shape`, with ``segment``).
    Removes everything on exit, killing what still runs in the namespaces."""
    tag = f"fg{os.getpid() % 100000}"
    hub = f"{tag}-hub"
    created: list[str] = []
    addresses = {name: f"{SUBNET}.{10 + i}" for i, name in enumerate(names)}
    hosts: dict[str, Host] = {}
    try:
        ip("netns", "add", hub)
        created.append(hub)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            host = Host(name, f"{tag}-{i}", addresses[name], f"{tag}n{i}", f"{tag}h{i}")
            ip("netns", "add", host.namespace)
            created.append(host.namespace)
            ip("link", "add", host.port, "type", "veth", "peer", "name", host.device)
            ip("link", "set", host.port, "netns", hub)
            ip("link", "set", host.device, "netns", host.namespace)
            ip("-n", hub, "link", "set", host.port, "master", "br0", "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
            ip("-n", host.namespace, "link", "set", host.device, "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, a in addresses.items()]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            hosts[name] = host
        net = Network(hub, hosts)
        with contextlib.ExitStack() as stack:
            if link is not None:
                stack.enter_context(shaped(net, link, segment))
            yield net
    finally:
        for ns in reversed(created):
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@contextlib.contextmanager
def namespaces(names: list[str]) -> Iterator[dict[str, str]]:
    """:func:`network`, unshaped, as name -> namespace, plus ``"__hub__"``,
    the bridge's."""
    with network(names) as net:
        yield {name: host.namespace for name, host in net.hosts.items()} | {"__hub__": net.hub}


# One Ethernet frame: a segment of this size is never cut.
FRAME = 1514


def gso_size(burst: int) -> int:
    """The largest TCP segment (TSO/GSO) a host hands its link, for a
    token bucket of ``burst`` bytes: one that fits the bucket whole.

    [Note: the bed's segments] A segment larger than tbf's bucket is cut by
    tbf into frames, in software, and every frame then travels the bed's
    whole path alone: a bridge, a second token bucket, two veth hops, the
    receiving namespace's stack and the ACKs back, each on the cores that
    train (about 45 us a frame in this VM, whose timers exit to the
    hypervisor). At 100 Mbit/s (a 16 KiB bucket) 200 KB each way cost about
    13 ms of CPU; with segments that fit the bucket, about 2 ms, at the
    same rate (docs/benchmarks-history.md, "The test bed's own cost at 100
    Mbit/s"). A real sender's NIC cuts segments in hardware, and a real receiver pays for
    its own frames only, not for the path's emulation. Its receiver does see
    a slow link's frames one at a time, though: a test of per-frame costs
    asks for :data:`FRAME`. tbf counts a segment's headers once per frame,
    hence the quarter's margin. Not set above 64 KiB (1 Gbit/s and up: the
    default)."""
    return min(64 << 10, burst * 3 // 4)


def shape(net: Network, rate: int, segment: int | None = None) -> None:
    """Limit each host's link to ``rate`` bits per second each way: a token
    bucket (tc tbf) on its veth's way out of the namespace, and one on the
    bridge port's way out towards it. ``segment``: the largest TCP segment
    a host hands its link (None: :func:`gso_size`'s; :data:`FRAME`: one
    frame at a time, as a real slow link's receiver sees them arrive)."""
    # tbf sleeps on high-resolution timers, so a bucket of about a
    # millisecond keeps the rate smooth; at least a few full-size frames.
    burst = max(16 << 10, rate // 8 // 1000)
    limit = max(2 * burst, int(rate / 8 * QUEUE_S))
    if segment is None:
        segment = gso_size(burst)
    for host in net.hosts.values():
        for namespace, device in ((host.namespace, host.device), (net.hub, host.port)):
            ip("-n", namespace, "link", "set", "dev", device, "gso_max_size", str(segment))
            tc(
                *("-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf"),
                *("rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)),
            )


@contextlib.contextmanager
def delayed(net: Network, rtt: float) -> Iterator[list[subprocess.Popen[str]]]:
    """A round trip of ``rtt`` seconds between any two hosts of ``net``:
    half of it on each host's way in, by a delayer per host (see [Note:
    where the delay goes] in client/delayer.py). Yields the delayers'
    processes (none for no delay); they end on exit."""
    with contextlib.ExitStack() as stack:
        procs = []
        if rtt:
            for host in net.hosts.values():
                procs.append(
                    stack.enter_context(
                        delaying(
                            host.namespace, f"{SUBNET}.0/24", delay_ms=rtt * 1e3 / 2, incoming=True
                        )
                    )
                )
        yield procs


@contextlib.contextmanager
def shaped(net: Network, link: Link, segment: int | None = None) -> Iterator[Network]:
    """``net`` with every host's link shaped to ``link``: its rate
    (:func:`shape`) and its round trip (:func:`delayed`). The rate goes with
    the namespaces; the delayers end on exit."""
    if link.rate:
        shape(net, link.rate, segment)
    with delayed(net, link.rtt):
        yield net


# ---------------------------------------------------------------- streams

BLOCK = 4 << 20


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """What a raw TCP stream between two hosts reached, in bits per second:
    one way, and each way with both ways at once (as a ring's ranks send
    and receive)."""

    one_way: float
    both_ways: float


def send_bytes(sock: socket.socket, total: int) -> None:
    """Send ``total`` bytes of a preallocated buffer: no Python copies, only
    the kernel's."""
    buf = memoryview(bytearray(min(total, BLOCK)))
    left = total
    while left:
        n = min(left, BLOCK)
        sock.sendall(buf[:n])
        left -= n


def recv_bytes(sock: socket.socket, total: int) -> float:
    """Receive ``total`` bytes into a preallocated buffer; the rate over the
    second half of them (bits per second): past the connection's set-up and
    TCP's ramp, a steady stream's rate."""
    buf = memoryview(bytearray(min(total, BLOCK)))
    left = total
    half_at, half_left = 0.0, 0
    while left:
        n = sock.recv_into(buf, min(left, BLOCK))
        if not n:
            raise ConnectionError("peer closed early")
        left -= n
        if not half_at and left <= total // 2:
            half_at, half_left = time.monotonic(), left
    elapsed = time.monotonic() - half_at
    return half_left * 8 / elapsed if elapsed > 0 else 0.0


def exchange(sock: socket.socket, total: int, send: bool, recv: bool) -> float:
    """Send and/or receive ``total`` bytes on ``sock`` at once (the sending
    on a thread); :func:`recv_bytes`'s rate, 0 if not receiving."""
    sender = threading.Thread(target=send_bytes, args=(sock, total)) if send else None
    if sender is not None:
        sender.start()
    rate = recv_bytes(sock, total) if recv else 0.0
    if sender is not None:
        sender.join()
    return rate


def _stream_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.netlab stream")
    parser.add_argument("--listen", type=int, help="accept one connection on this port")
    parser.add_argument("--connect", help="HOST:PORT")
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--both", action="store_true", help="send and receive at once")
    args = parser.parse_args(argv)
    if args.listen is not None:
        with socket.create_server(("0.0.0.0", args.listen)) as server:
            print("LISTENING", flush=True)
            sock, _ = server.accept()
        # The listener receives; with --both it also sends.
        rate = exchange(sock, args.bytes, send=args.both, recv=True)
    else:
        host, _, port = args.connect.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.settimeout(None)
        rate = exchange(sock, args.bytes, send=True, recv=args.both)
    # Both ends done before either closes: no reset cuts the other short.
    sock.sendall(b"k")
    sock.recv(1)
    sock.close()
    print(json.dumps({"rate": rate}), flush=True)
    return 0


def stream(src: Host, dst: Host, nbytes: int, both: bool = False, port: int = 29400) -> float:
    """A raw TCP stream of ``nbytes`` from ``src`` to ``dst`` (and back at
    the same time with ``both``), each end a process in its host's
    namespace: the slower direction's rate over the second half of the
    bytes, bits per second."""
    cmd = [sys.executable, "-m", "client.netlab", "stream", "--bytes", str(nbytes)]
    cmd += ["--both"] if both else []

    def start(host: Host, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            host.run(*cmd, *extra), stdout=subprocess.PIPE, text=True, env=checkout_env(), cwd=ROOT
        )

    listener = start(dst, "--listen", str(port))
    sender: subprocess.Popen[str] | None = None
    try:
        assert listener.stdout is not None
        if listener.stdout.readline().strip() != "LISTENING":
            raise RuntimeError("the stream's listener did not start")
        sender = start(src, "--connect", f"{dst.address}:{port}")
        outs = [p.communicate(timeout=300)[0] for p in (listener, sender)]
    finally:
        for p in (listener, sender):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    rates = [float(json.loads(out.strip().splitlines()[-1])["rate"]) for out in outs]
    return min(r for r in rates if r > 0)


def stream_ceiling(src: Host, dst: Host, nbytes: int) -> Ceiling:
    """The link's own ceiling between two hosts: :func:`stream` one way,
    then both ways at once."""
    return Ceiling(stream(src, dst, nbytes), stream(src, dst, nbytes, both=True))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stream"]:
        return _stream_main(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
