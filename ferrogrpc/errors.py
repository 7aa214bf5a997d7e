"""The ferrogrpc error hierarchy: one root, one class per way things fail.

Every error carries the identity of where it happened (``rank``, ``world_size``,
``peer``, ``op``, ``seq``, ``step``) and prints it as a prefix, for example
``[rank 2/4 all_reduce#17 step 3 peer 1] ...``.
"""

from __future__ import annotations


class FerroGrpcError(Exception):
    """Root of every error ferrogrpc raises.

    ``rank`` is the rank that raised it, ``peer`` the rank the error is about
    (the culprit, where one is known), ``op`` and ``seq`` the collective and its
    sequence number, ``step`` the ring step.
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
        # True when this error may be the echo of a failure another rank
        # found (a stream it failed on purpose), whose report may follow.
        self.echo = False
        # True when it carries another rank's report rather than what this
        # rank found itself.
        self.reported = False
        # True when the peer could not be reached at all (its server refuses
        # connections: the process is gone), as opposed to not answering.
        self.gone = False

    def prefix(self) -> str:
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
        CollectiveTimeoutError,
        ProtocolError,
    )
}
