"""One epoch of an elastic group, as ElasticBackend lives it: what it is
(Membership), what moves into it (the group's state, a sharded model's
shards), starting its peer while the last epoch's closes, the ways its
start or its settling fails, and what a heartbeat says about it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import torch

from ..control.membership_client import EpochRendezvous
from ..env import Settings
from ..errors import FerroGrpcError
from ..runtime.join import Ahead
from ..runtime.peer import Peer
from ..v1 import rendezvous_pb2 as rpb

# How long the last epoch's failure notices may take to land when this
# process moves to the next epoch (a Peer's close waits 2 s).
NOTICE_GRACE_S = 0.2


@dataclasses.dataclass(frozen=True)
class Membership:
    """An elastic group's current epoch: its number (1 for the first), its
    size, and its members' addresses in rank order."""

    epoch: int
    world_size: int
    members: tuple[str, ...]
    # The members' host keys, in rank order (ranks that share one share a
    # host), where the coordinator knows them.
    hosts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Removal:
    """A heartbeat's news that the group moves on without finishing this
    process's epoch: without ranks of it, or without this process (``me``)."""

    me: bool
    ranks: list[int]
    message: str
    culprit: int | None


def removal(response: rpb.HeartbeatResponse, epoch: int) -> Removal | None:
    """What ``response`` says about ``epoch`` (None: nothing to act on)."""
    me = not response.member and response.epoch >= epoch
    ranks = list(response.removed) if response.epoch == epoch else []
    moving_on = response.recover_pending and response.epoch == epoch
    if me:
        message = (
            "this process was removed from the elastic group (silent past "
            "FERROGRPC_HEARTBEAT_TIMEOUT): it joins again at the next step boundary"
        )
        return Removal(True, ranks, message, None)
    if moving_on and ranks:
        message = (
            f"ranks {ranks} of epoch {epoch} were removed from the elastic group (lost, or "
            "silent past FERROGRPC_HEARTBEAT_TIMEOUT): the group moves on without them"
        )
        return Removal(False, ranks, message, ranks[0])
    return None


class Settling(Exception):  # noqa: N818 - a hand-off, not a fault
    """A new epoch failed as it settled (``error``), after this process had
    (``rejoined``) or had not received the state in it."""

    def __init__(self, error: FerroGrpcError, rejoined: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.rejoined = rejoined


class GroupState(Protocol):
    """What a member hands to joiners (ElasticState, state.py)."""

    step: int

    # True while this process lacks part of the group's state (a receipt
    # still landing, or one that failed).
    incomplete: bool

    def send_to_joiners(self, joined_from: int) -> None: ...
    def receive_from_members(self, joined_from: int) -> int: ...
    def finish_transfer(self) -> None: ...
    def abandon_transfer(self) -> None: ...
    def rejoined(self) -> None: ...


class Resharder(Protocol):
    """A sharded model of an elastic group (FSDP's ElasticShards): its shards
    move at every new epoch (see [Note: shards held twice])."""

    def sharded_parameters(self) -> list[torch.Tensor]: ...
    def attach(self, optimizer: torch.optim.Optimizer) -> None: ...
    def reshard(self, joined: bool) -> Callable[[], None]: ...
    def held_bytes(self, world: int, moments: int) -> int: ...


class StartFailed(Exception):  # noqa: N818 - a hand-off, not a fault
    """An epoch formed (``formed``, this process's table), but this process's
    peer in it failed to start (``error``)."""

    def __init__(self, formed: rpb.EnterResponse, error: FerroGrpcError) -> None:
        super().__init__(str(error))
        self.formed = formed
        self.error = error


async def start_peer(
    old: Peer | None,
    rendezvous: EpochRendezvous,
    *,
    settings: Settings,
    bind_host: str,
    advertise_host: str | None,
    ahead: Ahead,
    closed_at: list[float],
) -> Peer:
    """The next epoch's peer, entered through ``rendezvous``. The ``old``
    peer closes while the next epoch's server starts and its Enter waits
    for the other members (unless a fixed port must be freed first); the
    new peer is built once it is closed (join.py's ``Ahead.closing``);
    ``closed_at[0]`` says when. The close took 1.4-5.1 ms of the 12-17 ms
    a 100 MB admission's forming took, and the slowest member's set when
    the coordinator answered. Six runs each, alternated (``client.bench
    --elastic``, three members): the members' first step with the joiner
    0.086-0.102 s longer than normal, against 0.097-0.106."""

    async def close_old() -> None:
        if old is not None:
            # The coordinator tells the members that the group moves on;
            # notices to a stalled member would hold this up by their
            # whole timeout.
            await old.close(notice_grace=NOTICE_GRACE_S)
        closed_at[0] = time.monotonic()

    if settings.port:  # the next server binds the same port: the old one goes first
        await close_old()
    else:  # it closes while the next epoch forms (Ahead.closing)
        ahead.closing = asyncio.ensure_future(close_old())
    try:
        return await Peer.start(
            None,
            None,
            rendezvous=rendezvous,
            bind_host=bind_host,
            port=settings.port,
            advertise_host=advertise_host,
            settings=settings,
            ahead=ahead,
        )
    finally:
        # A start that failed before the rendezvous was done: its error,
        # not the close's, is what the caller sees.
        with contextlib.suppress(Exception):
            await ahead.last_closed()
