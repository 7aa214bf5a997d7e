"""The coordinator's Prometheus metrics: its group, as the coordinator sees it.

``ferrogrpc coordinator --metrics-port P`` serves them (prometheus-client's
HTTP server, read at scrape time, as a rank's are: observe/metrics.py), and
``ferrogrpc status`` prints them. A group is either a rendezvous of ranks
that joined (``init_backend`` with a coordinator) or an elastic group
(epochs); both sets are served, the other's at zero:

- ``ferrogrpc_group_world_size`` and ``ferrogrpc_group_members`` (the ranks
  of the current round or epoch, and how many hold a slot now);
- ``ferrogrpc_group_epoch`` (0: no elastic epoch formed);
- ``ferrogrpc_group_joiners_waiting`` (admitted at the next step boundary),
  ``ferrogrpc_group_spares`` (waiting beyond ``max_world_size``, admitted
  once a member is lost) and ``ferrogrpc_group_max_world_size`` (0: none);
- ``ferrogrpc_group_joins_total``, ``ferrogrpc_group_removals_total``,
  ``ferrogrpc_group_rounds_total`` (rendezvous rounds released) and
  ``ferrogrpc_group_epochs_total`` (elastic epochs formed);
- per rank of a rendezvous round, ``ferrogrpc_group_heartbeat_age_seconds``
  and ``ferrogrpc_group_last_seq`` (the last collective its heartbeat
  reported: a rank behind the others is the one they wait for).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from .coordinator import Coordinator


class GroupCollector(Collector):
    """Reads ``coordinator``'s state at each scrape (on the HTTP server's
    thread: copies, never iterating a dict the loop may be changing)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterable[Metric]:
        c = self.coordinator
        m = c.membership
        members = dict(c._members)
        epoch_members = [p for p in list(m.members) if p is not None]
        elastic = m.epoch > 0
        world = GaugeMetricFamily(
            "ferrogrpc_group_world_size", "The ranks of the current round or elastic epoch"
        )
        world.add_metric([], len(epoch_members) if elastic else c.world_size)
        held = GaugeMetricFamily(
            "ferrogrpc_group_members", "Members holding a slot of the current round or epoch"
        )
        held.add_metric([], len(epoch_members) if elastic else len(members))
        epoch = GaugeMetricFamily(
            "ferrogrpc_group_epoch", "The elastic group's membership epoch (0: none formed)"
        )
        epoch.add_metric([], m.epoch)
        admit, spares = m.waiting() if elastic else ([], [])
        waiting = GaugeMetricFamily(
            "ferrogrpc_group_joiners_waiting",
            "Processes waiting to join an elastic group at its next step boundary",
        )
        waiting.add_metric([], len(admit))
        spare = GaugeMetricFamily(
            "ferrogrpc_group_spares",
            "Hot spares: processes waiting beyond max_world_size, admitted once a member is lost",
        )
        spare.add_metric([], len(spares))
        most = GaugeMetricFamily(
            "ferrogrpc_group_max_world_size", "An elastic epoch's most members (0: no limit)"
        )
        most.add_metric([], m.max_world_size)
        joins = CounterMetricFamily(
            "ferrogrpc_group_joins", "Peers given a rank: by Join, or by entering an epoch"
        )
        joins.add_metric([], c.joins + m.joined_total)
        removals = CounterMetricFamily(
            "ferrogrpc_group_removals", "Members an elastic epoch dropped (lost or silent)"
        )
        removals.add_metric([], m.removed_total)
        rounds = CounterMetricFamily(
            "ferrogrpc_group_rounds", "Rendezvous rounds released (each a run of the job)"
        )
        rounds.add_metric([], c.rounds)
        epochs = CounterMetricFamily("ferrogrpc_group_epochs", "Elastic epochs formed")
        epochs.add_metric([], m.formed)
        age = GaugeMetricFamily(
            "ferrogrpc_group_heartbeat_age_seconds",
            "Seconds since each rank's last heartbeat (rendezvous rounds)",
            labels=["rank"],
        )
        seq = GaugeMetricFamily(
            "ferrogrpc_group_last_seq",
            "The last collective each rank's heartbeat reported (rendezvous rounds)",
            labels=["rank"],
        )
        now = time.time()
        for rank, member in sorted(members.items()):
            if member.last_heartbeat:
                age.add_metric([str(rank)], max(0.0, now - member.last_heartbeat))
            seq.add_metric([str(rank)], member.seq)
        return [world, held, epoch, waiting, spare, most, joins, removals, rounds, epochs, age, seq]


class GroupMetricsServer:
    """The coordinator's metrics on ``host:port`` (0: an ephemeral port)."""

    def __init__(self, coordinator: Coordinator, host: str, port: int) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(GroupCollector(coordinator))
        self._httpd: WSGIServer | None
        self._httpd, self._thread = start_http_server(port, host, registry)
        self.port: int = self._httpd.server_port
        coordinator.metrics_port = self.port

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            self._thread.join(timeout=5)


# What ``ferrogrpc status`` prints, in this order: (metric, words).
_SUMMARY = (
    ("ferrogrpc_group_world_size", "world size"),
    ("ferrogrpc_group_members", "members"),
    ("ferrogrpc_group_epoch", "epoch"),
    ("ferrogrpc_group_joins_total", "joins"),
    ("ferrogrpc_group_removals_total", "removals"),
    ("ferrogrpc_group_rounds_total", "rounds"),
    ("ferrogrpc_group_epochs_total", "epochs formed"),
    ("ferrogrpc_group_joiners_waiting", "joiners waiting"),
    ("ferrogrpc_group_spares", "spares"),
)


def describe(url: str, timeout: float = 5.0) -> str:
    """The group metrics at ``url`` (a coordinator's ``/metrics``), as
    ``ferrogrpc status`` prints them: one line of totals, then each rank's
    last reported collective. Raises OSError when they cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except urllib.error.URLError as exc:
        raise OSError(f"{url}: {exc.reason}") from exc
    values: dict[str, float] = {}
    seqs: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ferrogrpc_group_last_seq":
                seqs[sample.labels["rank"]] = sample.value
            elif not sample.labels:
                values[sample.name] = sample.value
    words = [f"{label} {values[name]:g}" for name, label in _SUMMARY if name in values]
    lines = [f"group metrics ({url}): " + ", ".join(words)]
    if seqs:
        ranks = sorted(seqs, key=int)
        lines.append("last seq by rank: " + " ".join(f"{r}:{seqs[r]:g}" for r in ranks))
    return "\n".join(lines)
