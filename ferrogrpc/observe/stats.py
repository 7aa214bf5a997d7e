"""The byte and collective counters every path adds to (peer.stats)."""

from __future__ import annotations

import dataclasses

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
    chunk or message."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    collectives: int = 0
    sent_by: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    received_by: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)

    def sent(self, peer: int, nbytes: int, path: str = GRPC) -> None:
        self.bytes_sent += nbytes
        key = (path, peer)
        self.sent_by[key] = self.sent_by.get(key, 0) + nbytes

    def received(self, peer: int, nbytes: int, path: str = GRPC) -> None:
        self.bytes_received += nbytes
        key = (path, peer)
        self.received_by[key] = self.received_by.get(key, 0) + nbytes

    def local(self, peer: int, nbytes: int) -> None:
        self.bytes_local += nbytes
        key = (SAME_HOST, peer)
        self.received_by[key] = self.received_by.get(key, 0) + nbytes
