"""A rank's wall-clock offset to rank 0, measured at start-up for the trace.

[Note: clock offset]
Each rank's trace stamps events with its own ``time.time()``; ranks on
different hosts disagree by their clocks' offset (NTP keeps them within
milliseconds, often less; a collective can take less). So a traced rank
asks rank 0 for its clock a few times, NTP-style: it reads its own clock
(t0), rank 0 answers a ping with its clock (t1), and it reads its own again
(t2). If rank 0's clock reads ``local + offset``, then t1 lies between
``t0 + offset`` and ``t2 + offset``, so the estimate ``t1 - (t0 + t2) / 2``
is off by at most half the round trip ``t2 - t0``. Of the samples, the one
with the shortest round trip is kept: its bound is the tightest.
``ferrogrpc trace merge`` adds the offset to every one of the rank's
timestamps, putting all ranks on rank 0's clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from ..transport.streams import Transport

# Round trips per measurement: enough for one not delayed by a busy loop.
SAMPLES = 8


@dataclasses.dataclass(frozen=True)
class ClockOffset:
    """What to add to this rank's ``time.time()`` to read rank
    ``reference``'s clock (``offset``, seconds), and the round trip of the
    sample it came from: the offset is within ``round_trip / 2``."""

    offset: float
    round_trip: float
    samples: int
    reference: int = 0

    @property
    def error_bound(self) -> float:
        return self.round_trip / 2

    def as_dict(self) -> dict[str, Any]:
        return {
            "offset_s": self.offset,
            "round_trip_s": self.round_trip,
            "error_bound_s": self.error_bound,
            "samples": self.samples,
            "reference_rank": self.reference,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClockOffset:
        return cls(
            float(d["offset_s"]),
            float(d["round_trip_s"]),
            int(d["samples"]),
            int(d.get("reference_rank", 0)),
        )


SAME_CLOCK = ClockOffset(0.0, 0.0, 0)
"""Rank 0's own offset (and a group of one's)."""


def offset_from(samples: Sequence[tuple[float, float, float]], reference: int = 0) -> ClockOffset:
    """The offset from ``(t0, t1, t2)`` samples (local send, remote clock,
    local receive): the one with the shortest round trip (see [Note: clock
    offset]). ValueError when there are none."""
    if not samples:
        raise ValueError("no clock samples")
    t0, t1, t2 = min(samples, key=lambda s: s[2] - s[0])
    return ClockOffset(t1 - (t0 + t2) / 2, t2 - t0, len(samples), reference)


async def measure(
    transport: Transport,
    rank: int,
    timeout: float,
    *,
    reference: int = 0,
    samples: int = SAMPLES,
) -> ClockOffset | None:
    """This rank's offset to ``reference``'s clock, from ``samples`` pings
    of ``timeout`` each over ``transport`` (see [Note: clock offset]).
    None when ``reference`` is too old to tell its clock. Raises the
    transport's PeerError if ``reference`` does not answer."""
    if rank == reference:
        return dataclasses.replace(SAME_CLOCK, reference=reference)
    taken: list[tuple[float, float, float]] = []
    for _ in range(samples):
        t0 = time.time()
        remote = await transport.wall_clock(reference, timeout)
        t2 = time.time()
        if remote == 0.0:
            return None
        taken.append((t0, remote, t2))
    return offset_from(taken, reference)
