"""Metrics per rank (issue 32): scrape the HTTP endpoint a group of ranks
serves, parse it with prometheus-client's parser, and check every value
against what the collectives run must have done: counts of the calls made,
bytes by peer computed from the tensor sizes and the ring's schedule, the
failure an injected fault causes, the port rule, and that closing stops
serving. And the coordinator's group metrics, as ``ferrogrpc status``
prints them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import ferrogrpc as fg
from ferrogrpc.control.coordinator import Coordinator, CoordinatorRendezvous
from ferrogrpc.control.group_metrics import GroupMetricsServer, describe
from ferrogrpc.env import Settings
from ferrogrpc.errors import Identity
from ferrogrpc.observe import flight, metrics
from ferrogrpc.observe.flight import Entry
from ferrogrpc.observe.observer import DDP_BUCKET_WAIT, FSDP_RESHARD, Observer, Span
from ferrogrpc.observe.stats import TCP_MESH, Stats
from ferrogrpc.runtime.peer import Peer, observer_of
from ferrogrpc.testing import Fault, FaultKind, local_group
from tests.helpers import (
    RANKS,
    SUBNET,
    backends,
    clean_env,
    free_port,
    ip,
    namespaces,
    on_ranks,
    rank_env,
    spawn_rank,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample at ``url``, by (name, labels)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


async def ascrape(url: str) -> Samples:
    return await asyncio.to_thread(scrape, url)


def value(samples: Samples, name: str, **labels: object) -> float:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def delta(after: Samples, before: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def bytes_by_peer(d: Samples, name: str, rank: int, path: str) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for (metric, labels), v in d.items():
        lab = dict(labels)
        if metric == name and lab["rank"] == str(rank) and lab["path"] == path:
            out[int(lab["peer"])] += v
    return dict(out)


def url_of(peer: Peer) -> str:
    server = metrics.server_of(observer_of(peer))
    assert server is not None
    return f"http://127.0.0.1:{server.port}/metrics"


async def test_a_scrape_counts_every_collective_and_every_byte_by_peer() -> None:
    world, runs, gathers = 3, 3, 2
    numel = 3 * (1 << 18)  # 3 MiB of float32, divisible by the world: a ring
    part = 1 << 18  # each rank's 1 MiB part of an all-gather: a ring too
    settings = Settings(metrics_port=0)
    async with local_group(world, settings=settings, direct=False) as peers:
        url = url_of(peers[0])
        # One server for the process: every rank of the group is on it.
        assert {url_of(p) for p in peers} == {url}
        before = await ascrape(url)
        for _ in range(runs):
            tensors = [torch.full((numel,), float(r)) for r in range(world)]
            await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
        for _ in range(gathers):
            got = await asyncio.gather(
                *(p.all_gather(torch.full((part,), float(r))) for r, p in enumerate(peers))
            )
            assert all(torch.equal(g[2], torch.full((part,), 2.0)) for g in got)
        d = delta(await ascrape(url), before)
    nbytes = numel * 4
    # A ring all-reduce sends 2 (W-1)/W of the tensor to the right
    # neighbour; a ring all-gather sends W-1 parts. Nothing to anyone else.
    expected = runs * 2 * (world - 1) * nbytes // world + gathers * (world - 1) * part * 4
    for r in range(world):
        right, left = (r + 1) % world, (r - 1) % world
        assert bytes_by_peer(d, "ferrogrpc_sent_bytes_total", r, "grpc") == {right: expected}
        assert bytes_by_peer(d, "ferrogrpc_received_bytes_total", r, "grpc") == {left: expected}
        assert value(d, "ferrogrpc_collectives_total", rank=r, op="all_reduce", outcome="done") == (
            runs
        )
        assert value(d, "ferrogrpc_collectives_total", rank=r, op="all_gather", outcome="done") == (
            gathers
        )
        count = "ferrogrpc_collective_seconds_count"
        assert value(d, count, rank=r, op="all_reduce", size="<16MiB") == runs
        le = "ferrogrpc_collective_seconds_bucket"
        assert value(d, le, rank=r, op="all_reduce", size="<16MiB", le="+Inf") == runs
        assert value(d, "ferrogrpc_collective_seconds_sum", rank=r, op="all_reduce", size="<16MiB")
        assert not any(name == "ferrogrpc_failures_total" for name, _ in d)
        assert value(before, "ferrogrpc_world_size", rank=r) == world
        assert value(before, "ferrogrpc_membership_epoch", rank=r) == 0


async def test_shared_memory_bytes_are_counted_by_peer() -> None:
    world, numel = 2, 1 << 20  # 4 MiB: through the shared segments
    async with local_group(world, transport="shm", settings=Settings(metrics_port=0)) as peers:
        url = url_of(peers[0])
        before = await ascrape(url)
        tensors = [torch.full((numel,), float(r + 1)) for r in range(world)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
        assert torch.equal(tensors[0], torch.full((numel,), 3.0))
        d = delta(await ascrape(url), before)
    for r in range(world):
        # Each rank reads the other's half to reduce its own, then the
        # other's reduced half: the whole tensor, from its one peer.
        other = 1 - r
        assert bytes_by_peer(d, "ferrogrpc_received_bytes_total", r, "same_host") == {
            other: numel * 4
        }
        assert bytes_by_peer(d, "ferrogrpc_sent_bytes_total", r, "grpc") == {}
        assert value(d, "ferrogrpc_collectives_total", rank=r, op="all_reduce", outcome="done") == 1


async def test_a_failure_is_counted_by_kind_and_culprit() -> None:
    fault = Fault(rank=1, kind=FaultKind.CORRUPT_PAYLOAD, nth=0, collective="all_reduce")
    async with local_group(
        3, settings=Settings(metrics_port=0), direct=False, faults=[fault]
    ) as peers:
        url = url_of(peers[0])
        before = await ascrape(url)
        tensors = [torch.ones(3 << 18) for _ in peers]
        results = await asyncio.gather(
            *(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)),
            return_exceptions=True,
        )
        d = delta(await ascrape(url), before)
    assert all(isinstance(e, fg.FerroGrpcError) for e in results), results
    # The rank the corrupt chunk reached names its sender.
    assert results[2].peer == 1, results[2]  # type: ignore[union-attr]
    for r, err in enumerate(results):
        assert isinstance(err, fg.FerroGrpcError)
        culprit = "none" if err.peer is None else str(err.peer)
        failed = value(d, "ferrogrpc_collectives_total", rank=r, op="all_reduce", outcome="failed")
        assert failed == 1
        kinds = {
            (dict(k)["kind"], dict(k)["culprit"]): v
            for (name, k), v in d.items()
            if name == "ferrogrpc_failures_total" and dict(k)["rank"] == str(r)
        }
        assert kinds == {(type(err).__name__, culprit): 1.0}, (r, err)


def _free_pair() -> int:
    """A port P with P and P + 1 both free now, below the kernel's ephemeral
    range: a port found free by binding port 0 is an ephemeral one, which
    any bind to port 0 (a gRPC server of this or another xdist worker) may
    take before the metrics server binds it (seen once in a full run: the
    scrape reached a gRPC server)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low - 1)
        with contextlib.suppress(OSError), socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 1))
            return port
    raise AssertionError("no two adjacent free ports")


async def test_ranks_on_one_host_serve_on_port_plus_local_index_and_close_stops() -> None:
    port = _free_pair()
    settings = Settings(metrics_port=port, bind_host="127.0.0.1")
    # Two ranks sharing a host (shared memory): one port each.
    async with local_group(2, transport="shm", settings=settings) as peers:
        for r in range(2):
            samples = await ascrape(f"http://127.0.0.1:{port + r}/metrics")
            assert {dict(k)["rank"] for n, k in samples if n == "ferrogrpc_world_size"} == {str(r)}
        assert len(_serving_threads()) == 2
    assert metrics.servers() == []
    for r in range(2):
        with pytest.raises(urllib.error.URLError):
            await ascrape(f"http://127.0.0.1:{port + r}/metrics")
    # Ranks that are hosts of their own (shared memory off) in one process:
    # the same port, one server, a rank label each.
    async with local_group(2, settings=settings, direct=False) as peers:
        samples = await ascrape(f"http://127.0.0.1:{port}/metrics")
        ranks = {dict(k)["rank"] for n, k in samples if n == "ferrogrpc_world_size"}
        assert ranks == {"0", "1"}
        assert url_of(peers[1]).endswith(f":{port}/metrics")
    assert metrics.servers() == []
    assert _serving_threads() == []


@pytest.mark.timeout(60)
def test_processes_with_shared_memory_off_serve_on_port_plus_local_rank(tmp_path: Path) -> None:
    # Shared memory off, every rank is a host of its own (place 0): without
    # LOCAL_RANK the second process could not bind the port and ran without
    # metrics. torchrun and `ferrogrpc launch` set it; it picks the offset.
    port, master = _free_pair(), free_port()
    env = {
        "FERROGRPC_SHM": "0",
        "FERROGRPC_METRICS_PORT": str(port),
        "FERROGRPC_BIND_HOST": "127.0.0.1",
    }
    procs = [
        spawn_rank(
            "metrics_rank.py", str(tmp_path), env=rank_env(r, 2, master, LOCAL_RANK=str(r), **env)
        )
        for r in range(2)
    ]
    try:
        wait_until(lambda: all("READY" in p.stdout for p in procs), 40, "both ranks ready")
        for r in range(2):
            samples = scrape(f"http://127.0.0.1:{port + r}/metrics")
            assert {dict(k)["rank"] for n, k in samples if n == "ferrogrpc_world_size"} == {str(r)}
            assert (
                value(
                    samples, "ferrogrpc_collectives_total", rank=r, op="all_reduce", outcome="done"
                )
                >= 1
            )
    finally:
        (tmp_path / "release").write_text("")
        outputs = [p.communicate(timeout=30)[0] for p in procs]
    assert "no metrics" not in "".join(outputs), outputs


def _serving_threads() -> list[threading.Thread]:
    # prometheus-client's HTTP server runs serve_forever on its own thread.
    return [t for t in threading.enumerate() if "serve_forever" in t.name]


async def test_off_by_default() -> None:
    async with local_group(2, settings=Settings()) as peers:
        assert metrics.server_of(observer_of(peers[0])) is None
        assert observer_of(peers[0]).collective_sinks == []
        assert metrics.servers() == []


async def test_the_coordinator_serves_its_group_and_status_prints_it() -> None:
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    server = GroupMetricsServer(coordinator, "127.0.0.1", 0)
    try:
        target = f"127.0.0.1:{port}"
        url = f"http://127.0.0.1:{server.port}/metrics"
        empty = await ascrape(url)
        assert value(empty, "ferrogrpc_group_joins_total") == 0
        assert value(empty, "ferrogrpc_group_members") == 0
        a, b = CoordinatorRendezvous(target, timeout=10), CoordinatorRendezvous(target, timeout=10)
        await asyncio.gather(
            a.exchange(None, None, "h-a:1", "na"), b.exchange(None, None, "h-b:2", "nb")
        )
        samples = await ascrape(url)
        assert value(samples, "ferrogrpc_group_joins_total") == 2
        assert value(samples, "ferrogrpc_group_rounds_total") == 1
        assert value(samples, "ferrogrpc_group_members") == 2
        assert value(samples, "ferrogrpc_group_world_size") == 2
        assert value(samples, "ferrogrpc_group_epoch") == 0
        assert value(samples, "ferrogrpc_group_last_seq", rank=0) == 0
        # `ferrogrpc status` finds the port in the Status answer and prints them.
        from ferrogrpc.cli import main

        printed = await asyncio.to_thread(_output_of, main, ["status", target])
        assert "world size 2, members 2, epoch 0, joins 2, removals 0, rounds 1" in printed
        assert describe(url).splitlines()[0] in printed
        await asyncio.gather(a.close(), b.close())
    finally:
        server.stop()
        await coordinator.stop(0)


def _output_of(main: object, argv: list[str]) -> str:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0  # type: ignore[operator]
    return out.getvalue()


def test_ddp_bucket_waits_are_timed_once_per_bucket_per_step() -> None:
    steps = 3
    ranks = backends(2, metrics_port=0)
    try:
        torch.manual_seed(0)
        models = [nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)) for _ in ranks]
        ddps = on_ranks(lambda r: fg.DDP(models[r], ranks[r], bucket_size_bytes=1024), 2)
        url = url_of(ranks[0].peer)
        before = scrape(url)
        x = torch.randn(6, 8)

        def train(r: int) -> float:
            start = time.monotonic()
            for _ in range(steps):
                ddps[r](x[r * 3 : (r + 1) * 3]).sum().backward()
                ddps[r].sync_gradients()
            return time.monotonic() - start

        took = on_ranks(train, 2)
        d = delta(scrape(url), before)
    finally:
        for b in ranks:
            b.close()
    for r in range(2):
        # Each bucket is one all-reduce per step, and one wait for it.
        reduces = value(d, "ferrogrpc_collectives_total", rank=r, op="all_reduce", outcome="done")
        assert reduces >= steps and reduces % steps == 0, d
        waits = value(d, "ferrogrpc_ddp_bucket_wait_seconds_count", rank=r)
        assert waits == reduces, d
        waited = value(d, "ferrogrpc_ddp_bucket_wait_seconds_sum", rank=r)
        assert 0 < waited < took[r]
    assert metrics.servers() == []


# GETs each URL given; prints {url: "metrics" (a ferrogrpc exposition) or
# the error's class}.
_HTTP_PROBE = """
import json, sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
out = {}
for url in sys.argv[1:]:
    try:
        with opener.open(url, timeout=3) as r:
            body = r.read().decode()
        out[url] = "metrics" if "ferrogrpc_world_size" in body else "other"
    except Exception as exc:
        reason = getattr(exc, "reason", exc)
        out[url] = type(reason).__name__
print(json.dumps(out))
"""


def _http_probe(namespace: str, urls: list[str]) -> dict[str, str]:
    proc = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", _HTTP_PROBE, *urls],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.timeout(120)
def test_metrics_listen_on_the_peers_bind_host_seen_from_another_host() -> None:
    # SECURITY.md: metrics listen on the peer's bind host. A rank in the
    # namespace "host" (addresses HOST and SECOND), probed from "outsider".
    assert os.geteuid() == 0, "needs root for ip netns (CI runs as root)"
    host, second = f"{SUBNET}.10", f"{SUBNET}.20"
    cases = {
        # A single-machine job binds loopback: so must its metrics.
        "loopback job": {"MASTER_ADDR": "127.0.0.1"},
        # A multi-host job binds every interface, and Prometheus scrapes it.
        "network job": {"MASTER_ADDR": host},
        # A bind host named: only that address.
        "FERROGRPC_BIND_HOST": {"MASTER_ADDR": host, "FERROGRPC_BIND_HOST": second},
    }
    with namespaces(["host", "outsider"]) as ns:
        device = next(
            line.split(":")[1].strip().split("@")[0]
            for line in ip("-n", ns["host"], "-o", "link", "show").stdout.splitlines()
            if ": lo:" not in line
        )
        ip("-n", ns["host"], "addr", "add", f"{second}/24", "dev", device)
        # A fresh namespace: every port is free in it.
        ports = {case: free_port() for case in cases}
        procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for case, env in cases.items():
                procs[case] = subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns["host"],
                        sys.executable,
                        str(RANKS / "bind_probe.py"),
                    ],
                    env=dict(
                        clean_env(),
                        RANK="0",
                        WORLD_SIZE="1",
                        MASTER_PORT=str(free_port()),
                        FERROGRPC_METRICS_PORT=str(ports[case]),
                        **env,
                    ),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            for case, proc in procs.items():
                assert proc.stdout is not None
                seen: list[str] = []
                for line in proc.stdout:  # blocks until the peer is up, or gone
                    seen.append(line)
                    if line.startswith("LISTENING "):
                        break
                else:
                    raise AssertionError((case, "".join(seen)))
            urls = {
                case: [f"http://{a}:{port}/metrics" for a in (host, second, "127.0.0.1")]
                for case, port in ports.items()
            }
            outside = _http_probe(ns["outsider"], [u for us in urls.values() for u in us[:2]])
            inside = _http_probe(ns["host"], [u for us in urls.values() for u in us])
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    assert proc.stdin is not None
                    proc.stdin.write("done\n")
                    proc.stdin.flush()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    seen_from = {
        case: (outside[us[0]], outside[us[1]], inside[us[1]], inside[us[2]])
        for case, us in urls.items()
    }
    print("outsider -> host, second; host -> second, loopback:", seen_from)
    refused = "ConnectionRefusedError"
    # Reachable on the machine's loopback only: never from another host.
    assert seen_from["loopback job"] == (refused, refused, refused, "metrics"), seen_from
    assert seen_from["network job"] == ("metrics",) * 4, seen_from
    # Only on the address named.
    assert seen_from["FERROGRPC_BIND_HOST"] == (refused, "metrics", "metrics", refused), seen_from


def test_an_observation_on_a_buckets_bound_lands_in_that_bucket() -> None:
    # Issue 56 item 18: ``le`` is inclusive, for every bound, for the
    # latency histogram fed by a collective and for a wait's.
    hist = metrics.Histogram()
    for bound in metrics.SECONDS_BUCKETS:
        hist.observe(bound)
    cumulative = dict(hist.buckets())
    for i, bound in enumerate(metrics.SECONDS_BUCKETS):
        assert cumulative[repr(bound)] == i + 1, (bound, cumulative)
    assert cumulative["+Inf"] == len(metrics.SECONDS_BUCKETS)

    slot = metrics.RankMetrics(Identity(0, 2, ["h:0", "h:1"]), Stats())
    entry = Entry(3, "all_reduce", 64, "float32")
    entry.called, entry.ended, entry.state = 1000.0, 1000.5, flight.DONE
    slot.on_collective(entry)
    slot.on_span(Span(DDP_BUCKET_WAIT, "bucket", 2000.0, 2000.25, {}, 0))
    for hist, bound, below in (
        (slot.latency[("all_reduce", "<64KiB")], "0.5", "0.25"),
        (slot.waits[DDP_BUCKET_WAIT], "0.25", "0.1"),
    ):
        cumulative = dict(hist.buckets())
        assert (cumulative[below], cumulative[bound]) == (0, 1), cumulative


def test_byte_counters_keep_every_retired_epochs_bytes() -> None:
    # Issue 56 item 19: an elastic member's rank in one process over three
    # epochs (an observer each, closed in turn): its place on the metrics
    # server keeps the bytes of both retired epochs, and adds the live one's.
    # (Counted from what the place held when the first epoch took it: a
    # place another test's rank retired from may be taken.)
    settings = Settings(metrics_port=0)
    release = metrics.hold(settings)
    observers: list[Observer] = []
    places: list[metrics.RankMetrics] = []
    try:
        for epoch, (sent, received) in enumerate(((100, 7), (20, 3000), (3, 40000))):
            if observers:
                observers[-1].close()
            observer = Observer(Identity(epoch % 2, 2, ["h:0", "h:1"]))
            observers.append(observer)
            server = metrics.attach(observer, settings)
            assert server is not None
            places += [s for s in server.ranks if s.stats is observer.stats]
            if epoch == 0:
                base_sent, base_received = places[0].bytes_by()
            observer.stats.sent(1 - epoch % 2, sent)
            observer.stats.received(1 - epoch % 2, received, path=TCP_MESH)
            if epoch == 1:
                observer.stats.sent(1 - epoch % 2, 5, path=TCP_MESH)
        slot = places[0]
        assert places == [slot] * 3, "each epoch takes the last one's place"
        mine_sent = {("grpc", 1): 100 + 3, ("grpc", 0): 20, (TCP_MESH, 0): 5}
        mine_received = {(TCP_MESH, 1): 7 + 40000, (TCP_MESH, 0): 3000}
        sent_by, received_by = slot.bytes_by()
        for got, base, mine in (
            (sent_by, base_sent, mine_sent),
            (received_by, base_received, mine_received),
        ):
            delta = {k: n - base.get(k, 0) for k, n in got.items() if n != base.get(k, 0)}
            assert delta == mine, (got, base)
        observers[-1].close()  # the third retires too: nothing lost
        assert slot.bytes_by() == (sent_by, received_by)
    finally:
        for observer in observers:
            observer.close()
        release()


def test_an_elastic_fsdp_reshard_is_counted_and_its_seconds_kept() -> None:
    # Issue 57 item 7: a re-shard is a span (FSDP_RESHARD) on the new
    # epoch's observer; the metrics count them and keep the last one's
    # seconds, never as a wait. The counter is there, at 0, before the
    # first; the gauge appears with it.
    settings = Settings(metrics_port=0)
    observer = Observer(Identity(1, 3, ["h:0", "h:1", "h:2"]))
    try:
        server = metrics.attach(observer, settings)
        assert server is not None
        url = f"http://127.0.0.1:{server.port}/metrics"
        before = scrape(url)
        assert ("ferrogrpc_fsdp_reshards_total", frozenset({("rank", "1")})) in before
        assert value(before, "ferrogrpc_fsdp_reshards_total", rank=1) == 0
        assert not [k for k in before if k[0].startswith("ferrogrpc_fsdp_last_reshard")]
        reshard = "re-shard 4 -> 3 ranks"
        observer.record(FSDP_RESHARD, reshard, 1000.0, 1000.75, elements=9, received_bytes=72)
        observer.record(FSDP_RESHARD, reshard, 2000.0, 2000.25, elements=9, received_bytes=48)
        after = scrape(url)
        assert value(after, "ferrogrpc_fsdp_reshards_total", rank=1) == 2
        assert value(after, "ferrogrpc_fsdp_last_reshard_seconds", rank=1) == 0.25
        assert value(after, "ferrogrpc_fsdp_last_reshard_received_bytes", rank=1) == 48
        waits = [k for k in after if k[0].startswith("ferrogrpc_fsdp_") and "wait" in k[0]]
        assert all(after[k] == 0 for k in waits), waits
    finally:
        observer.close()


@pytest.mark.timeout(150)
def test_a_joiners_reshard_shows_in_every_members_metrics_and_trace(tmp_path: Path) -> None:
    # Issue 57 item 7, with real processes (tests/ranks/elastic_fsdp.py):
    # two members of an elastic FSDP, then a joiner. Every member of the
    # grown group counts one re-shard and its seconds on its metrics port
    # (the members' places kept across epochs: port + 0, + 1; the joiner's
    # + 2), and its trace shows the re-shard as a slice with its epoch,
    # world sizes and elements; the point-to-point messages that moved the
    # shards are in the same file.
    from ferrogrpc.observe import trace
    from tests.test_elastic_fsdp import FsdpRun, elastic_train  # type: ignore[attr-defined]

    port = free_port()
    traces = tmp_path / "trace"
    run = FsdpRun(
        tmp_path,
        2,
        STEPS="80",
        SLOW="0",
        PACE="0.1",
        FERROGRPC_METRICS_PORT=str(port),
        FERROGRPC_TRACE=str(traces),
        END_FILE=str(tmp_path / "end-step"),
    )
    try:
        run.wait_for(lambda: [d for d in run.lines() if d.get("step", 0) >= 3], 60, "no steps")
        run.start_rank()
        run.wait_for(lambda: [d for d in run.lines(2) if "idx" in d], 60, "the joiner trains")
        scraped = [scrape(f"http://127.0.0.1:{port + k}/metrics") for k in range(3)]
        run.end_soon()
        codes = run.finish(90)
    finally:
        run.close()
    assert codes == [0, 0, 0], (codes, run.output())
    received: dict[str, float] = {}
    for k, samples in enumerate(scraped):
        counts = {
            dict(labels)["rank"]: v
            for (name, labels), v in samples.items()
            if name == "ferrogrpc_fsdp_reshards_total"
        }
        assert list(counts.values()) == [1], (k, counts)
        (rank,) = counts
        assert value(samples, "ferrogrpc_membership_epoch", rank=rank) >= 2, k
        seconds = value(samples, "ferrogrpc_fsdp_last_reshard_seconds", rank=rank)
        assert 0 < seconds < 30, (k, seconds)
        received[rank] = value(samples, "ferrogrpc_fsdp_last_reshard_received_bytes", rank=rank)
    # The joiner (rank 2 of 3) received its shard and the copy it keeps
    # (of rank 1's), whole but for the padding: parameters and Adam's two
    # moments, float64.
    shards = [(n, -(-n // 3)) for n in (p.numel() for p in elastic_train.model().parameters())]
    elements = sum((n - 2 * s) + (min(2 * s, n) - s) for n, s in shards)
    assert received["2"] == 3 * 8 * elements, received
    # The members held the whole model already (each its shard and the
    # other's copy): they take their new pieces from themselves.
    assert received["0"] == 0 and received["1"] == 0, received
    grown = []
    kinds: list[set[str]] = []
    for path in trace.trace_files(traces):
        events = trace.load(path)["traceEvents"]
        slices = [e for e in events if e.get("cat") == FSDP_RESHARD]
        if slices:
            (reshard,) = slices
            assert reshard["args"]["world_size"] == 3, reshard
            assert reshard["args"]["from_world_size"] == 2, reshard
            assert reshard["args"]["elements"] > 0, reshard
            p2p = {
                e["name"]
                for e in events
                if e.get("cat") == "collective" and e["name"] in ("send", "recv")
            }
            assert p2p, f"{path}: no point-to-point message"
            kinds.append(p2p)
            grown.append(reshard["args"]["epoch"])
    assert len(grown) == 3 and len(set(grown)) == 1, grown
    # The members sent the joiner its pieces; it received them.
    assert any("send" in k for k in kinds) and any("recv" in k for k in kinds), kinds
