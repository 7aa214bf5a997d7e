"""The byte and collective counters every path adds to (peer.stats)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Stats:
    """Bytes this peer moved, for throughput reports: over the transport
    (sent, received), and read from other ranks' shared segments (local)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    collectives: int = 0
