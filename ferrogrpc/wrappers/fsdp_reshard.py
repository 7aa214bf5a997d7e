"""Elastic FSDP's pure part: which rank holds which shard and its copy (a
layout), and the pieces that move when the group changes (no
communication, testable without a group). See [Note: shards held twice].

[Note: shards held twice]
In an elastic group, FSDP keeps every shard on two ranks: its owner, which
trains it, and a *buddy*, which keeps a copy of it and of its optimizer
state. Buddies are ranks a fixed number of places apart, the number that
puts the most of them on another host than their owner (the next rank on
a single host), so that each rank keeps exactly one copy. At each
gradient sync every owner hands its reduced gradient shard to its buddy
(one all_to_all of the group: through the shared segments where one host
holds it, the shards already laid out as the message, UnitRuntime's
grad_offsets), and once the sync is committed (through the coordinator,
as elastic DDP's) the buddy applies the same optimizer step to its copy, with the
same optimizer: owner and copy stay bitwise equal, and a copy is never
older than a committed step.

When the group changes (a member lost, or joiners admitted), every member
computes the same plan: for each parameter and each rank of the new
layout, its own shard and the copy it keeps are cut from the pieces of
the old layout's shards, each taken from the receiving rank itself if it
holds it (as the old owner or its buddy), else from the old owner if it
is still a member, else from its buddy. A shard whose owner and buddy are both gone
is lost: ShardLostError on every member. The pieces travel as
point-to-point messages, one per pair of ranks, and the new layout takes
effect only once that change is committed through the coordinator (until
then every member keeps the old one, which the next attempt starts from).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

# A piece's role on a rank: the shard it owns, or the copy it keeps.
OWN, COPY = 0, 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """Who holds what: ``world`` ranks in the order of ``hosts`` (one host
    key per rank), as formed in ``epoch`` (0: no layout)."""

    epoch: int
    world: int
    hosts: tuple[str, ...]

    def offset(self) -> int:
        """Every rank's buddy is the rank this many places after it: the
        offset that puts the most buddies on another host (the smallest of
        those), so that each rank keeps exactly one copy."""
        if len(self.hosts) != self.world:
            return 1

        def away(d: int) -> int:
            return sum(self.hosts[k] != self.hosts[(k + d) % self.world] for k in range(self.world))

        return max(range(1, self.world), key=lambda d: (away(d), -d))

    def buddy(self, rank: int) -> int | None:
        """The rank keeping ``rank``'s copy (None alone)."""
        if self.world < 2:
            return None
        return (rank + self.offset()) % self.world

    def copy_of(self, rank: int) -> int | None:
        """Whose shard ``rank`` keeps a copy of (the inverse of buddy)."""
        if self.world < 2:
            return None
        return (rank - self.offset()) % self.world

    def shard_numel(self, numel: int) -> int:
        return -(-numel // max(1, self.world))


@dataclasses.dataclass(frozen=True)
class Piece:
    """``length`` elements of parameter ``entry`` (and of each of its
    optimizer state planes): from rank ``src``'s ``src_role`` shard at
    ``src_lo``, to rank ``dst``'s ``dst_role`` shard at ``dst_lo`` (ranks of
    the new layout)."""

    entry: int
    src: int
    src_role: int
    src_lo: int
    dst: int
    dst_role: int
    dst_lo: int
    length: int


class Lost(Exception):  # noqa: N818 - a verdict, not a fault
    """Shards of the old layout with no holder left (``shards``: their old
    ranks, each with its buddy)."""

    def __init__(self, shards: list[int], buddies: list[int | None]) -> None:
        super().__init__(f"shards {shards} lost with their buddies {buddies}")
        self.shards = shards
        self.buddies = buddies


def plan(
    numels: Sequence[int],
    old: Layout,
    holders: Mapping[int, int],
    new: Layout,
) -> list[Piece]:
    """The pieces that make ``new`` from ``old``: ``holders`` maps a rank of
    the old layout that is still a member (and holds its shards) to its
    rank in the new one. Raises Lost if some old shard has neither its
    owner nor its buddy among them (and a parameter has elements in it)."""

    def sources(k: int) -> list[tuple[int, int]]:
        found = [(holders[k], OWN)] if k in holders else []
        buddy = old.buddy(k)
        if buddy is not None and buddy in holders:
            found.append((holders[buddy], COPY))
        return found

    lost = sorted(
        k
        for k in range(old.world)
        if not sources(k) and any(k * old.shard_numel(n) < n for n in numels)
    )
    if lost:
        raise Lost(lost, [old.buddy(k) for k in lost])
    pieces: list[Piece] = []
    for index, numel in enumerate(numels):
        s_old, s_new = old.shard_numel(numel), new.shard_numel(numel)
        for dst in range(new.world):
            targets = [(dst, OWN), (new.copy_of(dst), COPY)]
            for shard, role in targets:
                if shard is None:
                    continue
                lo, hi = shard * s_new, min((shard + 1) * s_new, numel)
                while lo < hi:
                    k = lo // s_old
                    end = min(hi, (k + 1) * s_old)
                    # (Owner and copy are bitwise equal: the one the
                    # receiver holds itself moves nothing.)
                    options = sources(k)
                    src, src_role = next((o for o in options if o[0] == dst), options[0])
                    pieces.append(
                        Piece(
                            index,
                            src,
                            src_role,
                            lo - k * s_old,
                            dst,
                            role,
                            lo - shard * s_new,
                            end - lo,
                        )
                    )
                    lo = end
    return pieces
