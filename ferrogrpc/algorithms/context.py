"""The rank's context: what every algorithm gets of the rank it runs on.

An algorithm (a ring lane, a one-exchange, a same-host round) takes a
:class:`RankContext`, never the peer: it can run on a
:class:`~ferrogrpc.transport.streams.MemoryTransport` with nothing else.
"""

from __future__ import annotations

import dataclasses

from ..errors import Identity
from ..failure.policy import FailurePolicy
from ..options import Timeouts
from ..transport.integrity import Checksum
from ..transport.streams import Transport
from .mailboxes import Mailboxes


@dataclasses.dataclass
class Stats:
    """Bytes this peer moved, for throughput reports: over the transport
    (sent, received), and read from other ranks' shared segments (local)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    collectives: int = 0


@dataclasses.dataclass
class RankContext:
    """Everything an algorithm uses of its rank: who this rank is (and every rank's address),
    its group and session nonce, the checksum, the timeouts, the transport,
    the mailboxes incoming streams wait in, the failure policy, and the
    byte counters. Mutable only between collectives (a benchmark switches
    the checksum on every rank at once)."""

    identity: Identity
    transport: Transport
    mailboxes: Mailboxes
    failure: FailurePolicy
    timeouts: Timeouts
    checksum: Checksum | None
    group: int = 0
    nonce: str = ""
    stats: Stats = dataclasses.field(default_factory=Stats)
