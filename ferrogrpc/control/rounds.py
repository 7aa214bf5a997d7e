"""What an elastic group's membership records and answers (membership.py):
a process as an epoch lists it, the forming of an epoch, and the verdicts
an Enter or a Commit may get instead of an answer."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from ..v1 import rendezvous_pb2 as rpb


@dataclasses.dataclass
class Entry:
    """A process as an epoch lists it."""

    peer_id: str
    address: str
    nonce: str
    host: str = ""
    min_world_size: int = 0
    max_world_size: int = 0

    @classmethod
    def entering(cls, request: rpb.EnterRequest) -> Entry:
        """The process that sends ``request``, with its settings."""
        r = request
        return cls(r.peer_id, r.address, r.nonce, r.host, r.min_world_size, r.max_world_size)


class SettingMismatch(Exception):  # noqa: N818 - a verdict, not a fault
    """A joiner's setting differs from the group's (answered INVALID_ARGUMENT:
    the joiner raises ConfigError, and the members go on)."""


class NotAdopted(Exception):  # noqa: N818 - a verdict, not a fault
    """An Enter or a Commit of an epoch this coordinator neither formed nor
    adopted (answered UNAVAILABLE: the caller retries, and the heartbeats
    that adopt its epoch may arrive meanwhile)."""


class GroupOver(Exception):  # noqa: N818 - a verdict, not a fault
    """A joiner (a spare, say) still waited when every member of the group
    left: training is done (answered OUT_OF_RANGE: the joiner raises
    RendezvousError, and never starts a group of its own)."""


class QuorumLostInRound(Exception):  # noqa: N818 - a verdict, not a fault
    """The next epoch would have fewer than ``min_world_size`` members."""

    def __init__(self, lost: Sequence[int], remaining: int, minimum: int) -> None:
        super().__init__(
            f"quorum lost: ranks {sorted(lost)} of the group are lost, {remaining} remain, "
            f"min_world_size is {minimum}"
        )
        self.lost = sorted(lost)
        self.remaining = remaining
        self.minimum = minimum


def admitted(waiting: Sequence[str], kept: int, most: int) -> list[str]:
    """The joiners (``waiting``, in the order they came) that an epoch of
    ``kept`` members admits: all of them, or up to ``most`` members (0: no
    limit). The others wait as spares, admitted once members are lost."""
    return list(waiting) if not most else list(waiting[: max(0, most - kept)])


def placed(result: rpb.EnterResponse, rank: int) -> rpb.EnterResponse:
    """An epoch's table (``result``), as the member at ``rank`` is answered."""
    answer = rpb.EnterResponse()
    answer.CopyFrom(result)
    answer.rank = rank
    return answer


def check_setting(entry: Entry, group_min: int, group_max: int) -> None:
    """A joiner of a running group must run with the group's
    min_world_size and max_world_size: SettingMismatch if it does not (one
    joiner's setting never changes the group's bounds)."""
    for name, mine, group in (
        ("min_world_size", entry.min_world_size, group_min),
        ("max_world_size", entry.max_world_size, group_max),
    ):
        if mine and group and mine != group:
            variable = f"FERROGRPC_{name.upper()}"
            raise SettingMismatch(
                f"this process runs with {name} {mine} ({variable}, or init_backend's "
                f"{name}), but the group it joins runs with {group}: every process of an "
                "elastic group must use the same value"
            )


@dataclasses.dataclass
class _Round:
    """The forming of epoch ``epoch``."""

    epoch: int
    reason: int
    # Rank order of the new epoch: kept members in their old order, then joiners.
    order: list[str]
    joined_from: int
    # Ranks of the previous epoch dropped from this one.
    dropped: list[int]
    entered: dict[str, Entry] = dataclasses.field(default_factory=dict)
    done: asyncio.Future[rpb.EnterResponse | None] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
