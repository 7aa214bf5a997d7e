"""Which ranks share a host, and the two-level layout that follows from it.

Pure bookkeeping, no I/O. Every rank publishes a *host key* at rendezvous
(see ``plane.host_key``): ranks with equal non-empty keys share memory and a
network namespace, so they exchange tensor bytes through shared memory; the
others talk over gRPC. Every rank computes the same :class:`Topology` from
the same table.

Hosts are ordered by their lowest rank, and a host's ranks by rank; a rank's
*local index* is its place on its host. For the hierarchical all-reduce the
tensor is cut into ``K = max(ranks per host)`` slices; on a host with ``L``
ranks, local index ``l`` owns the slices ``k`` with ``k % L == l``, so every
slice has exactly one owner per host, and slice ``k``'s owners form one ring
across the hosts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Topology:
    """The hosts of a group, as lists of global ranks."""

    hosts: tuple[tuple[int, ...], ...]
    # host_of[r]: the index in ``hosts`` of rank r's host.
    host_of: tuple[int, ...]

    @classmethod
    def from_keys(cls, keys: Sequence[str]) -> Topology:
        """Group ranks by host key; an empty key is a host of its own."""
        groups: dict[str, list[int]] = {}
        order: list[list[int]] = []
        for rank, key in enumerate(keys):
            if key and key in groups:
                groups[key].append(rank)
                continue
            group = [rank]
            order.append(group)
            if key:
                groups[key] = group
        host_of = [0] * len(keys)
        for index, group in enumerate(order):
            for rank in group:
                host_of[rank] = index
        return cls(tuple(tuple(g) for g in order), tuple(host_of))

    @classmethod
    def flat(cls, world_size: int) -> Topology:
        """Every rank a host of its own (no shared memory)."""
        return cls.from_keys([""] * world_size)

    @property
    def world_size(self) -> int:
        return len(self.host_of)

    def local(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s host, itself included, in rank order."""
        return self.hosts[self.host_of[rank]]

    def local_index(self, rank: int) -> int:
        return self.local(rank).index(rank)

    @property
    def single_host(self) -> bool:
        return len(self.hosts) == 1

    @property
    def shares_memory(self) -> bool:
        """Whether any host has more than one rank."""
        return any(len(h) > 1 for h in self.hosts)

    @property
    def slices(self) -> int:
        """K: slices of the hierarchical all-reduce (most ranks on a host)."""
        return max(len(h) for h in self.hosts)

    def owner(self, host: int, k: int) -> int:
        """The rank on ``host`` that owns slice ``k``."""
        ranks = self.hosts[host]
        return ranks[k % len(ranks)]

    def owned(self, rank: int) -> list[int]:
        """The slices ``rank`` owns."""
        local = self.local(rank)
        index = local.index(rank)
        return [k for k in range(self.slices) if k % len(local) == index]

    def ring(self, k: int) -> list[int]:
        """Slice ``k``'s ring across hosts: its owner on every host, in host
        order."""
        return [self.owner(h, k) for h in range(len(self.hosts))]

    def representative(self, host: int, root: int) -> int:
        """The rank that speaks for ``host`` in a broadcast from ``root``:
        the root on its own host, the lowest rank elsewhere."""
        return root if self.host_of[root] == host else self.hosts[host][0]

    def senders_to(self, rank: int) -> frozenset[int]:
        """Every rank that may open a gRPC stream to ``rank``: its left
        neighbour in the flat ring and in every cross-host ring or chain it
        is part of."""
        world = self.world_size
        out = {(rank - 1) % world}
        if len(self.hosts) > 1:
            for k in range(self.slices):
                ring = self.ring(k)
                if rank in ring:
                    out.add(ring[ring.index(rank) - 1])
            # Broadcast chains run over one representative per host; like
            # the ring's, a chain's stream also closes the loop, from its last
            # rank back to the first.
            for root in range(world):
                chain = self.chain(root)
                if rank in chain:
                    out.add(chain[chain.index(rank) - 1])
        out.discard(rank)
        return frozenset(out)

    def chain(self, root: int) -> list[int]:
        """A broadcast's cross-host chain from ``root``: one representative
        per host, starting at the root's host and going round in host order."""
        first = self.host_of[root]
        count = len(self.hosts)
        return [self.representative((first + i) % count, root) for i in range(count)]
