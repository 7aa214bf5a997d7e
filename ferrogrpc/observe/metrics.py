"""Prometheus metrics per rank: ``metrics_port`` / ``FERROGRPC_METRICS_PORT``.

[Note: metrics]
Off by default. When on, each rank's observer gets two sinks (one per
ended collective, one per wrapper wait) that bump plain ints and small
dicts in a :class:`RankMetrics`; the bytes are the counters every path
already adds to (``Stats``, split by path and peer). Nothing is formatted
until Prometheus scrapes: a :class:`MetricsServer` (prometheus-client's
HTTP server on its own thread) asks its collector, which reads the counters
then and builds prometheus-client's metric families.

Every series carries a ``rank`` label:

- ``ferrogrpc_sent_bytes_total{path, peer}`` and
  ``ferrogrpc_received_bytes_total{path, peer}``: path ``grpc``,
  ``tcp_mesh`` (small collectives between hosts) or ``same_host`` (shared
  segments, and the plane's Unix sockets; received only: a rank reads what
  the others wrote);
- ``ferrogrpc_collectives_total{op, outcome}``: outcome ``done`` or
  ``failed``;
- ``ferrogrpc_collective_seconds{op, size}``: a histogram of each
  collective's latency as its caller sees it (called to ended, queueing
  behind earlier collectives included), by size class (:data:`SIZE_CLASSES`:
  the bytes of this rank's tensor);
- ``ferrogrpc_failures_total{kind, culprit}``: failed collectives by error
  class and the rank the error names (``none``: it names none);
- ``ferrogrpc_ddp_bucket_wait_seconds``, ``ferrogrpc_fsdp_gather_wait_seconds``
  and ``ferrogrpc_fsdp_reduce_wait_seconds``: histograms of the waits the
  wrappers name (observer.py's span categories);
- ``ferrogrpc_world_size`` and ``ferrogrpc_membership_epoch`` (0 outside an
  elastic group);
- ``ferrogrpc_fsdp_reshards_total``, ``ferrogrpc_fsdp_last_reshard_seconds``
  and ``ferrogrpc_fsdp_last_reshard_received_bytes`` (elastic FSDP): the
  re-shards this rank took part in at a new epoch; how long the last took,
  from its first message to the new layout in effect, and the bytes of
  shards it received in it (its span, ``FSDP_RESHARD``: the gauges appear
  with the first).

One server per port, per process, shared by every rank the process runs
and by every epoch of an elastic member: a new epoch's observer takes over
its predecessor's :class:`RankMetrics`, so the counters never go back.
Which port: see :func:`attach`. Closing the last rank on a server stops it
(its thread ends), unless an elastic backend holds the port between epochs
(:func:`hold`).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

from ..env import Settings
from ..errors import Identity
from .flight import FAILED, Entry
from .observer import (
    DDP_BUCKET_WAIT,
    FSDP_GATHER_WAIT,
    FSDP_REDUCE_WAIT,
    FSDP_RESHARD,
    Observer,
    Span,
)
from .stats import Stats

logger = logging.getLogger("ferrogrpc")

# The size classes of the latency histogram: (upper bound, exclusive; label).
SIZE_CLASSES: tuple[tuple[int, str], ...] = (
    (64 << 10, "<64KiB"),
    (1 << 20, "<1MiB"),
    (16 << 20, "<16MiB"),
)
LARGEST_CLASS = ">=16MiB"
_CLASS_BOUNDS = [bound for bound, _ in SIZE_CLASSES]
_CLASS_NAMES = [name for _, name in SIZE_CLASSES] + [LARGEST_CLASS]

# Histogram buckets, seconds: a small collective's 0.1 ms to a stalled
# rank's timeout.
SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BOUND_NAMES = (*map(repr, SECONDS_BUCKETS), "+Inf")

# The waits measured, by span category: their histogram's name and help.
WAITS: dict[str, tuple[str, str]] = {
    DDP_BUCKET_WAIT: (
        "ferrogrpc_ddp_bucket_wait_seconds",
        "How long DDP waited for each gradient bucket's all-reduce",
    ),
    FSDP_GATHER_WAIT: (
        "ferrogrpc_fsdp_gather_wait_seconds",
        "How long FSDP waited for each unit's parameter all-gather",
    ),
    FSDP_REDUCE_WAIT: (
        "ferrogrpc_fsdp_reduce_wait_seconds",
        "How long FSDP waited for each unit's gradient reduce-scatter",
    ),
}


def size_class(nbytes: int) -> str:
    """The latency histogram's size label for a collective of ``nbytes``."""
    return _CLASS_NAMES[bisect.bisect_right(_CLASS_BOUNDS, nbytes)]


class Histogram:
    """Counts per bucket (not cumulative; the last is +Inf) and a sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(SECONDS_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        # A bucket counts values <= its bound (Prometheus's ``le``).
        self.counts[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative, as an exposition has them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(_BOUND_NAMES, list(self.counts), strict=True):
            running += count
            out.append((bound, running))
        return out


class RankMetrics:
    """One rank's metrics in this process, across the observers of its
    epochs: the live observer's byte counters (``stats``), those of the
    observers before it (``past``), and what the sinks counted."""

    def __init__(self, identity: Identity, stats: Stats) -> None:
        self.identity = identity
        self.stats: Stats | None = stats
        self.past = Stats()
        self.epoch = 0
        self.collectives: dict[tuple[str, str], int] = {}
        self.latency: dict[tuple[str, str], Histogram] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.waits: dict[str, Histogram] = {}
        self.reshards = 0
        # The last re-shard's seconds and received bytes.
        self.last_reshard: tuple[float, int] | None = None

    # The sinks: on whatever thread ended the collective or the wait.

    def on_collective(self, entry: Entry) -> None:
        key = (entry.op, entry.state)
        self.collectives[key] = self.collectives.get(key, 0) + 1
        lat = (entry.op, size_class(entry.nbytes))
        hist = self.latency.get(lat)
        if hist is None:
            hist = self.latency[lat] = Histogram()
        hist.observe(max(0.0, entry.ended - entry.called))
        if entry.state == FAILED:
            culprit = "none" if entry.culprit is None else str(entry.culprit)
            fail = (entry.error_kind or "unknown", culprit)
            self.failures[fail] = self.failures.get(fail, 0) + 1

    def on_span(self, span: Span) -> None:
        if span.cat == FSDP_RESHARD:
            received = span.args.get("received_bytes", 0)
            self.last_reshard = (max(0.0, span.end - span.start), int(received))
            self.reshards += 1
            return
        if span.cat not in WAITS:
            return
        hist = self.waits.get(span.cat)
        if hist is None:
            hist = self.waits[span.cat] = Histogram()
        hist.observe(max(0.0, span.end - span.start))

    # Epochs.

    def take_over(self, identity: Identity, stats: Stats) -> None:
        """A new observer (the next epoch's) counts on from here."""
        self.identity = identity
        self.stats = stats

    def retire(self) -> None:
        """The live observer closed: keep what its counters hold."""
        stats, self.stats = self.stats, None
        if stats is not None:
            sent, received = stats.snapshot()
            for mine, theirs in ((self.past.sent_by, sent), (self.past.received_by, received)):
                for key, n in theirs.items():
                    mine[key] = mine.get(key, 0) + n

    def bytes_by(self) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
        """Bytes sent and received so far by (path, peer), every epoch's."""
        sent, received = dict(self.past.sent_by), dict(self.past.received_by)
        stats = self.stats
        if stats is not None:
            live_sent, live_received = stats.snapshot()
            for mine, theirs in ((sent, live_sent), (received, live_received)):
                for key, n in theirs.items():
                    mine[key] = mine.get(key, 0) + n
        return sent, received


class MetricsServer(Collector):
    """One port's HTTP server and the ranks it reports (a prometheus-client
    collector that reads their counters at each scrape)."""

    def __init__(self, requested: int, host: str, local_index: int) -> None:
        self.requested = requested
        self.ranks: list[RankMetrics] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        port = requested + local_index if requested else 0
        self._httpd: WSGIServer | None
        self._httpd, self._thread = start_http_server(port, host, self.registry)
        self.host = host
        self.port: int = self._httpd.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def live(self) -> bool:
        return any(r.stats is not None for r in self.ranks)

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            self._thread.join(timeout=5)

    def collect(self) -> Iterable[Metric]:
        with _lock:
            ranks = list(self.ranks)
        return _families(ranks)


def _families(ranks: list[RankMetrics]) -> Iterator[Metric]:
    sent = CounterMetricFamily(
        "ferrogrpc_sent_bytes",
        "Tensor bytes this rank sent, by path and destination rank",
        labels=["rank", "path", "peer"],
    )
    received = CounterMetricFamily(
        "ferrogrpc_received_bytes",
        "Tensor bytes this rank received (same_host: read from the other rank's memory), "
        "by path and source rank",
        labels=["rank", "path", "peer"],
    )
    collectives = CounterMetricFamily(
        "ferrogrpc_collectives",
        "Collectives (and sends and receives) ended, by op and outcome",
        labels=["rank", "op", "outcome"],
    )
    latency = HistogramMetricFamily(
        "ferrogrpc_collective_seconds",
        "Each collective's latency, from its call to its end, by op and size class",
        labels=["rank", "op", "size"],
    )
    failures = CounterMetricFamily(
        "ferrogrpc_failures",
        "Failed collectives, by error class and the rank the error names",
        labels=["rank", "kind", "culprit"],
    )
    waits = {
        cat: HistogramMetricFamily(name, doc, labels=["rank"]) for cat, (name, doc) in WAITS.items()
    }
    world = GaugeMetricFamily(
        "ferrogrpc_world_size", "The ranks of this rank's group", labels=["rank"]
    )
    epoch = GaugeMetricFamily(
        "ferrogrpc_membership_epoch",
        "The elastic group's membership epoch (0: not elastic)",
        labels=["rank"],
    )
    reshards = CounterMetricFamily(
        "ferrogrpc_fsdp_reshards",
        "Elastic FSDP: the re-shards this rank took part in (one per new epoch)",
        labels=["rank"],
    )
    last_reshard = GaugeMetricFamily(
        "ferrogrpc_fsdp_last_reshard_seconds",
        "Elastic FSDP: how long this rank's last re-shard took, from its first message "
        "to the new layout in effect",
        labels=["rank"],
    )
    last_received = GaugeMetricFamily(
        "ferrogrpc_fsdp_last_reshard_received_bytes",
        "Elastic FSDP: the bytes of shards (and their optimizer state) this rank received "
        "in its last re-shard",
        labels=["rank"],
    )
    for r in ranks:
        rank = str(r.identity.rank)
        by_sent, by_received = r.bytes_by()
        for (path, peer), n in sorted(by_sent.items()):
            sent.add_metric([rank, path, str(peer)], n)
        for (path, peer), n in sorted(by_received.items()):
            received.add_metric([rank, path, str(peer)], n)
        for (op, outcome), n in sorted(dict(r.collectives).items()):
            collectives.add_metric([rank, op, outcome], n)
        for (op, size), hist in sorted(dict(r.latency).items()):
            latency.add_metric([rank, op, size], hist.buckets(), hist.total)
        for (kind, culprit), n in sorted(dict(r.failures).items()):
            failures.add_metric([rank, kind, culprit], n)
        for cat, hist in dict(r.waits).items():
            waits[cat].add_metric([rank], hist.buckets(), hist.total)
        world.add_metric([rank], r.identity.world_size)
        epoch.add_metric([rank], r.epoch)
        reshards.add_metric([rank], r.reshards)
        if r.last_reshard is not None:
            last_reshard.add_metric([rank], r.last_reshard[0])
            last_received.add_metric([rank], r.last_reshard[1])
    yield from (sent, received, collectives, latency, failures, *waits.values(), world, epoch)
    yield from (reshards, last_reshard, last_received)


# The process's servers, and the elastic backends' holds, by requested port.
_lock = threading.Lock()
_servers: list[MetricsServer] = []
_holds: dict[int, int] = {}


def attach(observer: Observer, settings: Settings, local_index: int = 0) -> MetricsServer | None:
    """Serve ``observer``'s rank's metrics, if ``settings.metrics_port`` is
    set; the server (None: off, or the port could not be bound, which is
    logged and leaves the rank running without metrics).

    Which port: ``metrics_port`` plus ``local_index`` (``LOCAL_RANK`` where
    a launcher set it, else the rank's place among the ranks on its host:
    runtime/join.py), so that one setting serves every rank of a host, each
    on its own port; in compose each replica is a host of its
    own, so every one serves on ``metrics_port`` itself. 0 is one ephemeral
    port for the process (logged at INFO, and :func:`server_of` tells it).
    A process that already serves on that port adds the rank to it (ranks
    in one process; the next epoch of an elastic member takes over the
    last one's place, whatever its new rank). Binds ``settings.bind_host``,
    the host the rank's gRPC server binds (``Peer.start`` resolves it:
    loopback for a single-machine job), else loopback: plain HTTP, no
    token (SECURITY.md).
    """
    requested = settings.metrics_port
    if requested is None:
        return None
    me = observer.identity
    with _lock:
        server, slot = _place(requested, local_index)
        if slot is not None:
            slot.take_over(me, observer.stats)
        if server is None:
            host = settings.bind_host or "127.0.0.1"
            try:
                server = MetricsServer(requested, host, local_index)
            except OSError as exc:
                logger.warning(
                    "rank %d: no metrics: could not serve on %s port %d: %s",
                    me.rank,
                    host,
                    requested + local_index if requested else 0,
                    exc,
                )
                return None
            _servers.append(server)
            logger.info("rank %d: metrics on %s", me.rank, server.url)
        if slot is None:
            slot = RankMetrics(me, observer.stats)
            server.ranks.append(slot)
        _by_observer[id(observer)] = slot
    observer.collective_sinks.append(slot.on_collective)
    observer.span_sinks.append(slot.on_span)
    chosen, rank = server, slot

    def closed() -> None:
        with _lock:
            _by_observer.pop(id(observer), None)
            rank.retire()
            _stop_idle(chosen)

    observer.close_sinks.append(closed)
    return server


# Each live observer's RankMetrics (by id: the entry goes when it closes).
_by_observer: dict[int, RankMetrics] = {}


def _place(requested: int, local_index: int) -> tuple[MetricsServer | None, RankMetrics | None]:
    """Where a new observer's rank goes (under the lock): a retired place
    on a server for ``requested`` (an elastic member's next epoch), else a
    new place on the process's server for that port, else nowhere yet."""
    for server in _servers:
        if server.requested == requested:
            for slot in server.ranks:
                if slot.stats is None:
                    return server, slot
    port = requested + local_index if requested else 0
    for server in _servers:
        if (requested == 0 and server.requested == 0) or (requested and server.port == port):
            return server, None
    return None, None


def _stop_idle(server: MetricsServer) -> None:
    """Stop ``server`` (under the lock) if no rank is live on it and no
    elastic backend holds its port."""
    if server.live() or _holds.get(server.requested, 0) > 0:
        return
    with contextlib.suppress(ValueError):
        _servers.remove(server)
    server.stop()


def hold(settings: Settings) -> Callable[[], None]:
    """Keep this process's metrics servers for ``settings.metrics_port``
    serving between an elastic member's epochs (one closes before the next
    forms). Returns the release, to call once; it stops the servers no rank
    is live on."""
    requested = settings.metrics_port
    if requested is None:
        return lambda: None
    with _lock:
        _holds[requested] = _holds.get(requested, 0) + 1
    released = False

    def release() -> None:
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            _holds[requested] -= 1
            if not _holds[requested]:
                del _holds[requested]
            for server in [s for s in _servers if s.requested == requested]:
                _stop_idle(server)

    return release


def note_epoch(observer: Observer, epoch: int) -> None:
    """The membership epoch ``observer``'s rank is in (elastic groups)."""
    with _lock:
        slot = _by_observer.get(id(observer))
        if slot is not None:
            slot.epoch = epoch


def server_of(observer: Observer) -> MetricsServer | None:
    """The server reporting ``observer``'s rank (None: metrics are off)."""
    with _lock:
        slot = _by_observer.get(id(observer))
        for server in _servers:
            if slot is not None and slot in server.ranks:
                return server
    return None


def servers() -> list[MetricsServer]:
    """The process's metrics servers now serving."""
    with _lock:
        return list(_servers)
