"""The rate-limited test bed (client/netlab.py) and ``ferrogrpc bench
--link`` on it: the shaping is real (a transfer of N bytes takes at least
N x 8 / rate seconds, no stream beats the rate), the delay is real, and the
report has its fields. Needs root (ip netns, tc, iptables)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.netlab import Link, network, stream
from tests.helpers import ROOT, clean_env

RATE = 100_000_000  # bits per second


def test_a_link_is_a_rate_and_a_round_trip() -> None:
    assert Link.parse("100mbit,50ms") == Link(100_000_000, 0.05)
    assert Link.parse("1gbit") == Link(10**9, 0.0)
    assert Link.parse("2.5Gbit, 0.2s") == Link(2_500_000_000, 0.2)
    for bad in ("fast", "100mbit,50", "100 parsecs", "-1gbit"):
        with pytest.raises(ValueError):
            Link.parse(bad)


# A connection attempt's answer (here a refusal: nothing listens) comes
# back after one round trip; a host's own address is not over the link.
CONNECT = """
import socket, sys, time
began = time.monotonic()
try:
    socket.create_connection((sys.argv[1], 9), timeout=10)
except ConnectionRefusedError:
    pass
print(time.monotonic() - began)
"""


@pytest.mark.timeout(40)
def test_the_round_trip_is_added_between_hosts_and_not_to_a_host_itself() -> None:
    assert os.geteuid() == 0, "needs root for ip netns, tc and iptables (CI runs as root)"
    with network(["a", "b"], Link(RATE, 0.2)) as net:
        a, b = net.hosts["a"], net.hosts["b"]

        def connect(address: str) -> float:
            out = subprocess.run(
                a.run(sys.executable, "-c", CONNECT, address),
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
            return float(out.stdout)

        other, itself = connect(b.address), connect(a.address)
    assert 0.2 <= other < 1.0, other
    assert itself < 0.1, itself


@pytest.mark.timeout(40)
def test_a_shaped_link_keeps_tcp_segments_whole_and_its_rate() -> None:
    """[Note: the bed's segments] in client/netlab.py: at 100 Mbit/s (a
    16 KiB bucket) the segments a host hands its link fit the bucket, so
    tbf does not cut them into frames in software: the receiving device
    takes them whole (a frame is at most 1514 bytes). The rate is the
    link's all the same."""
    assert os.geteuid() == 0, "needs root for ip netns and tc (CI runs as root)"
    with network(["a", "b"], Link(RATE)) as net:
        a, b = net.hosts["a"], net.hosts["b"]

        def received() -> tuple[int, int]:
            stats = f"/sys/class/net/{b.device}/statistics"
            out = subprocess.run(
                b.run("cat", f"{stats}/rx_bytes", f"{stats}/rx_packets"),
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            return int(out[0]), int(out[1])

        before = received()
        # 12 MB (about 1 s at the rate): with 4 MB, a loaded host's start-up
        # delay weighed enough to read 82-84% of the rate (twice in 4 runs).
        rate = stream(a, b, 12_000_000)
        after = received()
    per_packet = (after[0] - before[0]) / (after[1] - before[1])
    assert per_packet > 4 * 1514, per_packet
    assert 0.85 * RATE <= rate <= RATE, rate


def _bench(figures: Path, size: str, pack: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``ferrogrpc bench --link 100mbit`` at world 2, one ``size``, with
    ``FERROGRPC_PACK=pack``; its figures in ``figures``. Asserts it passed."""
    assert os.geteuid() == 0, "needs root for ip netns, tc and iptables (CI runs as root)"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "client.bench", "--link", "100mbit"),
            *("--world-sizes", "2", "--sizes", size, "--iters", "2", "--warmup", "1"),
            *("--ceiling-s", "0.4", "--json", str(figures)),
        ],
        cwd=ROOT,
        env=dict(clean_env(), FERROGRPC_PACK=pack),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "# results ok" in proc.stdout, out
    return proc


@pytest.mark.timeout(40)
def test_the_link_bench_runs_on_a_shaped_link(tmp_path: Path) -> None:
    figures = tmp_path / "link.json"
    began = time.monotonic()
    # Every byte as it is (packed chunks have their own test below).
    proc = _bench(figures, "1M", "off", timeout=35)
    out = proc.stdout + proc.stderr
    for field in ("ceiling", "%link", "%ceil", "x gloo", "wire MB", "x ring", "data path grpc"):
        assert field in proc.stdout, (field, out)
    (link,) = json.loads(figures.read_text())
    assert link["link"] == {"rate_bps": RATE, "rtt_s": 0.0}
    # No raw stream beats the rate (unshaped veths run at several Gbit/s).
    ceiling = link["ceiling"]
    for rate in (ceiling["one_way_bps"], ceiling["both_ways_bps"]):
        assert 0.5 * RATE < rate <= RATE, ceiling
    (world,) = link["worlds"]
    assert world["world"] == 2 and world["data_path"] == ["grpc"], world
    rows = {row["impl"]: row for row in world["rows"]}
    assert set(rows) == {"gloo", "ferrogrpc"}, rows
    for impl, row in rows.items():
        # A ring all_reduce of 1 MiB at world 2: each rank sends 1 MiB, so
        # it takes at least 1 MiB x 8 / rate (less tbf's burst of 16 KiB).
        assert row["ring_bytes"] == 1 << 20, row
        floor_ms = ((1 << 20) - (16 << 10)) * 8 / RATE * 1e3
        assert row["ms_min"] >= floor_ms, (impl, row, floor_ms)
        assert row["goodput_pct_link"] <= 101, (impl, row)
        # Every byte of it crossed the rank's link, once.
        assert 1.0 <= row["wire_x_ring"] < 1.2, (impl, row)
        assert row["ok"], (impl, row)
    print(f"link bench, world 2, 1 MiB on 100 Mbit/s: {time.monotonic() - began:.1f} s")


@pytest.mark.timeout(60)
def test_a_slow_link_carries_packed_chunks(tmp_path: Path) -> None:
    # At 100 Mbit/s ferrogrpc's gauge finds the link slower than packing
    # (FERROGRPC_PACK=auto, the default): fewer bytes cross it than the
    # ring's float32 bytes, and every result is still right (the bench
    # checks each against the float64 sum of the ranks' normal values).
    # 8 MiB: chunks of 1 MiB, the least that is packed.
    figures = tmp_path / "link.json"
    _bench(figures, "8M", "auto", timeout=55)
    (link,) = json.loads(figures.read_text())
    (world,) = link["worlds"]
    rows = {row["impl"]: row for row in world["rows"]}
    assert rows["ferrogrpc"]["ok"] and rows["gloo"]["ok"], rows
    # gloo sends every byte (and the link's headers); packed normal values
    # are about 0.86 of them.
    assert rows["gloo"]["wire_x_ring"] >= 1.0, rows
    assert rows["ferrogrpc"]["wire_bytes"] < 0.9 * rows["gloo"]["wire_bytes"], rows
