"""The rank's context: what every algorithm gets of the rank it runs on.

An algorithm (a ring lane, a one-exchange, a same-host round) takes a
:class:`RankContext`, never the peer: it can run on a
:class:`~ferrogrpc.transport.streams.MemoryTransport` with nothing else.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from ..errors import Identity
from ..failure.policy import FailurePolicy
from ..observe.stats import Stats
from ..options import Timeouts
from ..transport.integrity import Checksum
from ..transport.planes import LinkGauge
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
    # Whether float32 chunks travel packed (transport/planes.py): "auto"
    # where a link's gauge says it is slower than packing, or "on", "off".
    packing: str = "off"
    gauges: dict[int, LinkGauge] = dataclasses.field(default_factory=dict)

    def gauge(self, peer: int) -> LinkGauge:
        """The gauge of the link to ``peer``, kept from collective to
        collective (a lane starts with what the last one learned). In mode
        "auto", a peer on this host (the same address, or loopback) is
        never packed for: no link between hosts is that slow."""
        gauge = self.gauges.get(peer)
        if gauge is None:
            mode = self.packing
            if mode == "auto" and _same_host(self.identity, peer):
                mode = "off"
            gauge = self.gauges[peer] = LinkGauge(mode)
        return gauge


def _same_host(me: Identity, peer: int) -> bool:
    """Whether ``peer``'s address is this rank's host or a loopback one."""
    host = me.address_of(peer).rpartition(":")[0].strip("[]")
    mine = me.address_of(me.rank).rpartition(":")[0].strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        if host == "localhost":
            return True
    return host == mine
