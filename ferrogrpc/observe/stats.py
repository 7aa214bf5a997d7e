"""The byte and collective counters every path adds to (peer.stats)."""

from __future__ import annotations

import dataclasses
import threading

# The paths bytes take (the metrics' ``path`` label): gRPC streams; the TCP
# mesh of small collectives between hosts (runtime/direct_mesh.py); and the
# same host (shared segments, and the plane's Unix sockets for small
# collectives).
GRPC = "grpc"
TCP_MESH = "tcp_mesh"
SAME_HOST = "same_host"


@dataclasses.dataclass
class Stats:
    """Bytes this peer moved, for throughput reports: over the network
    (sent, received: gRPC or the TCP mesh), and read from other ranks on its
    host (local). ``sent_by`` and ``received_by`` split the same bytes by
    (path, peer rank), for the metrics (observe/metrics.py): the sites call
    :meth:`sent`, :meth:`received` and :meth:`local`, a dict update each, per
    chunk or message, from the event loop and from the direct path's
    threads: under a lock, so that no count is lost between them."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    collectives: int = 0
    sent_by: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    received_by: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )

    def sent(self, peer: int, nbytes: int, path: str = GRPC) -> None:
        key = (path, peer)
        with self._lock:
            self.bytes_sent += nbytes
            self.sent_by[key] = self.sent_by.get(key, 0) + nbytes

    def received(self, peer: int, nbytes: int, path: str = GRPC) -> None:
        key = (path, peer)
        with self._lock:
            self.bytes_received += nbytes
            self.received_by[key] = self.received_by.get(key, 0) + nbytes

    def local(self, peer: int, nbytes: int) -> None:
        key = (SAME_HOST, peer)
        with self._lock:
            self.bytes_local += nbytes
            self.received_by[key] = self.received_by.get(key, 0) + nbytes

    def snapshot(self) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
        """Copies of ``sent_by`` and ``received_by``, taken together."""
        with self._lock:
            return dict(self.sent_by), dict(self.received_by)
