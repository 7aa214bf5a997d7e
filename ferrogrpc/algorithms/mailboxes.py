"""Mailboxes: where what arrives for a collective waits for it.

The stream intake (intake.py) delivers each incoming ring stream, and each
message of a small collective or a point-to-point send, to the mailbox of
its key; the algorithm that consumes it takes it from there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import Evidence, FerroGrpcError
from ..transport.streams import InStream
from ..v1 import collective_pb2 as pb

# Streams for collectives this rank has not reached yet wait in mailboxes; a
# sender can run ahead, but not without bound.
MAX_UNCLAIMED_STREAMS = 4096

# (group, seq, lane, src_rank) for a collective's stream or message (a
# message's part is its lane); (P2P_KEY, tag, n, part, src) for part of the
# n-th point-to-point message from src with that tag (its header's step).
MailboxKey = tuple[int, ...]
P2P_KEY = -1

# What arrives for a collective: a ring's stream, or one message of a small
# collective off a link (its payload). Which one tells the consumer whether
# the sender ran the collective the same way.
Arrival = tuple[pb.ChunkHeader, "InStream | memoryview"]


class Mailbox:
    """Where an incoming stream (or a link message) waits for the collective
    that consumes it: ``arrived`` is set by the intake, ``done`` by the
    consumer."""

    __slots__ = ("arrived", "done")

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.arrived: asyncio.Future[Arrival] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()


class Mailboxes:
    """The mailboxes of one rank, by (group, seq, lane, source rank)."""

    def __init__(self, limit: int = MAX_UNCLAIMED_STREAMS) -> None:
        self._boxes: dict[MailboxKey, Mailbox] = {}
        self._limit = limit
        # Told (seq, src, header) of every collective's stream or message the
        # intake delivers: the TCP mesh learns from it that a rank ran a
        # collective over gRPC that this rank runs on the direct sockets.
        self.on_arrival: Callable[[int, int, pb.ChunkHeader], None] | None = None

    def arrived(self, key: MailboxKey, arrival: Arrival) -> None:
        """Deliver ``arrival`` to the mailbox of ``key`` (the intake)."""
        self.get(key).arrived.set_result(arrival)
        if self.on_arrival is not None and key[0] != P2P_KEY:
            self.on_arrival(key[1], key[3], arrival[0])

    def get(self, key: MailboxKey) -> Mailbox:
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = Mailbox()
        return box

    def has(self, key: MailboxKey) -> bool:
        return key in self._boxes

    def full(self, key: MailboxKey) -> bool:
        return key not in self._boxes and len(self._boxes) >= self._limit

    def drop(self, key: MailboxKey) -> None:
        self._boxes.pop(key, None)

    def drop_seq(self, group: int, seq: int, err: FerroGrpcError) -> None:
        """Empty every mailbox of collective ``seq`` (nobody will consume
        them): a stream waiting in one fails with ``err``."""
        for key in [k for k in self._boxes if k[0] == group and k[1] == seq]:
            box = self._boxes.pop(key)
            if not box.done.done():
                box.done.set_exception(copy_refusal(err))
                box.done.exception()  # retrieved: nobody may be waiting


def copy_refusal(err: FerroGrpcError) -> FerroGrpcError:
    """``err`` for one more raiser, marked as a refusal: it fails a
    collective that will not run here."""
    return type(err)(err.message, peer=err.peer, evidence=Evidence.REFUSED)
