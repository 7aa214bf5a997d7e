"""The ferrogrpc error hierarchy: one root, one class per way things fail.

Every error carries the identity of where it happened (``rank``, ``world_size``,
``peer``, ``op``, ``seq``, ``step``) and prints it as a prefix, for example
``[rank 2/4 all_reduce#17 step 3 peer 1] ...``. It also carries the
:class:`Evidence` behind it, set when it is built: the failure policy
(``failure/policy.py``) uses it to decide which rank to blame.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, TypeVar


class Evidence(enum.Enum):
    """How this rank knows what an error says, for deciding whom to blame."""

    # This rank saw it itself: bad data, a mismatch, a deadline, a stuck
    # neighbour that did not answer.
    FOUND = "found"
    # A symptom: a stream that ended early, a write that failed. The named
    # neighbour may only have failed because of something else, and its
    # report of the cause may follow.
    SYMPTOM = "symptom"
    # The named peer cannot be reached at all: its server refuses
    # connections, so its process is gone.
    UNREACHABLE = "unreachable"
    # The named peer's host gave no answer at all: a slow or lossy link, or
    # a vanished host (a killed container swallows connection attempts).
    # Only silence that lasts is a death (see [Note: liveness probe]).
    SILENT = "silent"
    # Another rank's report of what it found, relayed to this rank.
    RELAYED = "relayed"
    # Another rank's own argument checks refused its call of this
    # collective (``peer`` names it): the collective fails on every rank,
    # and the group is not broken by it.
    REFUSED = "refused"


class FerroGrpcError(Exception):
    """Root of every error ferrogrpc raises.

    ``rank`` is the rank that raised it, ``peer`` the rank the error is about
    (the culprit, where one is known), ``op`` and ``seq`` the collective and its
    sequence number, ``step`` the ring step. ``evidence`` says how the
    raising rank knows (see :class:`Evidence`).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        peer: int | None = None,
        peer_address: str | None = None,
        op: str | None = None,
        seq: int | None = None,
        step: int | None = None,
        evidence: Evidence = Evidence.FOUND,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.world_size = world_size
        self.peer = peer
        self.peer_address = peer_address
        self.op = op
        self.seq = seq
        self.step = step
        self.evidence = evidence

    def prefix(self) -> str:
        """The identity this error prints before its message, such as
        ``"[rank 2/4 all_reduce#17 step 3 peer 1 (10.0.0.3:29500)] "``; empty
        when it carries none."""
        parts: list[str] = []
        if self.rank is not None:
            parts.append(
                f"rank {self.rank}/{self.world_size}" if self.world_size else f"rank {self.rank}"
            )
        if self.op is not None:
            parts.append(f"{self.op}#{self.seq}" if self.seq is not None else self.op)
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.peer is not None:
            where = f" ({self.peer_address})" if self.peer_address else ""
            parts.append(f"peer {self.peer}{where}")
        return "[" + " ".join(parts) + "] " if parts else ""

    def __str__(self) -> str:
        return self.prefix() + self.message


class ConfigError(FerroGrpcError, ValueError):
    """An argument, option or environment variable is invalid, or the ranks
    were configured differently (for example different models under DDP)."""


class RendezvousError(FerroGrpcError):
    """The ranks could not find each other: the store or coordinator was
    unreachable, or not every rank joined before the connect timeout."""


class PeerError(FerroGrpcError):
    """A peer failed or vanished: its connection broke, it exited, or it
    reported a failure of its own. ``peer`` names it."""


class QuorumLostError(PeerError):
    """An elastic group lost members and fewer than ``min_world_size``
    remain: training cannot go on. ``lost`` names the ranks lost (of the
    last epoch this rank was in)."""

    def __init__(self, message: str, *, lost: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.lost = sorted(lost or [])


class ShardLostError(PeerError):
    """An elastic FSDP group lost a shard with every copy of it: its owner and
    the buddy that kept a copy were lost in one change of epoch. Training
    cannot go on from memory; resume from the last sharded checkpoint.
    ``lost`` names the ranks lost and ``shards`` the lost shards (as ranks
    of the layout that held them)."""

    def __init__(
        self,
        message: str,
        *,
        lost: list[int] | None = None,
        shards: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.lost = sorted(lost or [])
        self.shards = sorted(shards or [])


class CollectiveTimeoutError(FerroGrpcError, TimeoutError):
    """A collective made no progress within the idle timeout, or did not finish
    within its deadline. ``peer`` names the rank this rank was waiting for."""


class ProtocolError(FerroGrpcError):
    """The ranks disagree about a collective (kind, dtype, size, op, root), or a
    peer sent data that is malformed or fails its checksum."""


ERROR_CLASSES: dict[str, type[FerroGrpcError]] = {
    cls.__name__: cls
    for cls in (
        FerroGrpcError,
        ConfigError,
        RendezvousError,
        PeerError,
        QuorumLostError,
        ShardLostError,
        CollectiveTimeoutError,
        ProtocolError,
    )
}

E = TypeVar("E", bound=FerroGrpcError)


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who raises: this rank, the group's size and every rank's address.
    Builds errors stamped with them."""

    rank: int
    world_size: int
    addresses: Sequence[str] = ()

    def address_of(self, rank: int) -> str:
        return self.addresses[rank] if 0 <= rank < len(self.addresses) else "?"

    def error(
        self,
        cls: type[E],
        message: str,
        *,
        op: str | None = None,
        seq: int | None = None,
        peer: int | None = None,
        evidence: Evidence = Evidence.FOUND,
    ) -> E:
        return cls(
            message,
            rank=self.rank,
            world_size=self.world_size,
            op=op,
            seq=seq,
            peer=peer,
            peer_address=self.address_of(peer) if peer is not None else None,
            evidence=evidence,
        )

    def stamp(
        self, exc: FerroGrpcError, op: str, seq: int, peer: int | None = None
    ) -> FerroGrpcError:
        """``exc`` as raised here: an error built without a rank (by a
        transport, say) gets this rank's identity, the collective, and
        ``peer`` as the culprit unless it names one; its evidence is kept."""
        if exc.rank is not None:
            return exc
        culprit = exc.peer if exc.peer is not None else peer
        return self.error(
            type(exc), exc.message, op=op, seq=seq, peer=culprit, evidence=exc.evidence
        )
