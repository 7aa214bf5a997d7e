"""The rank's context: what every algorithm gets of the rank it runs on.

An algorithm (a ring lane, a one-exchange, a same-host round) takes a
:class:`RankContext`, never the peer: it can run on a
:class:`~ferrogrpc.transport.streams.MemoryTransport` with nothing else.
"""

from __future__ import annotations

import dataclasses

from ..errors import Identity
from ..failure.policy import FailurePolicy
from ..observe.stats import Stats
from ..options import Timeouts
from ..transport.integrity import Checksum
from ..transport.streams import Transport
from .mailboxes import Mailboxes


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
