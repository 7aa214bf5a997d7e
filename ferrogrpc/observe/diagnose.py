"""``ferrogrpc diagnose DIR``: name the culprit from the ranks' flight records.

[Note: diagnosis]
Every rank that broke wrote its flight record (flight.py). The records of
one group (same ``group`` digest) are read together, and:

1. *The collective the others wait on* is the earliest one (lowest seq) that
   some rank had called but not finished when it broke.
2. Each rank is placed against it, from its own record alone:
   - **no record**: its process died (a SIGKILL, a lost container: then
     the others saw its stream end or its server refuse them) or it is still
     stopped; it cannot have broken cleanly, since a rank that breaks writes
     its record;
   - **never reached it**: its record ends before that collective;
   - **reached it late**: it called it only after the others had already
     given up on it (after the first of their records was written);
   - **in time**: it called it before anyone gave up.
3. The culprit is the rank that never reached the collective (or reached it
   late, or left no record), the *first* such rank when there are several:
   the one whose last sign of progress is the oldest. A rank that left no
   record is weighed by what the others' errors say: the one they name.
   When every rank reached the collective in time (bad data, a mismatch),
   the culprit is the rank the records' errors name most, counting a
   rank's own finding over a relayed one.

Nothing here trusts one rank's account: a stalled rank that wakes up and
writes a record naming someone else is placed by its own entries.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .flight import DONE, RUNNING, WAITING, load
from .schema import MAX_WORLD_SIZE

# The most files read: a record per rank of the largest group, four times.
MAX_RECORDS = 4 * MAX_WORLD_SIZE

# How much an error's evidence counts when the records must vote.
_WEIGHT = {"found": 3, "unreachable": 3, "silent": 3, "symptom": 1, "relayed": 1, "refused": 3}


@dataclasses.dataclass
class RankView:
    """One rank as its record shows it, against the collective waited on."""

    rank: int
    address: str
    # "no record", "never reached", "reached late", "in time"
    place: str
    last_progress: float | None  # when it last finished a collective (None: unknown)
    last_done: str | None  # that collective, as "op#seq"
    waiting_since: float | None  # when it called the collective waited on
    cause: dict[str, Any] | None
    dumped_at: float | None


@dataclasses.dataclass
class Diagnosis:
    """The verdict on one group's records."""

    group: str
    world_size: int
    ranks_with_records: list[int]
    op: str | None
    seq: int | None
    nbytes: int | None
    path: str | None
    gave_up_at: float | None
    culprit: int | None
    reason: str
    views: list[RankView]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read(directory: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Every flight record in ``directory``, by group, each checked
    (flight.load: see [Note: records read as hostile] in schema.py).
    ValueError, one line naming the file and the field, when there is none,
    the directory is missing, a file is not a record, or records of one
    group disagree on its world size."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such directory (where FERROGRPC_FLIGHT_DIR pointed)")
    files = sorted(folder.glob("flight-rank*.json"))
    if not files:
        raise ValueError(
            f"{folder}: no flight records (flight-rank*.json); a rank writes one when it "
            "breaks, if FERROGRPC_FLIGHT_DIR is set"
        )
    if len(files) > MAX_RECORDS:
        raise ValueError(f"{folder}: {len(files)} flight records, more than the {MAX_RECORDS} read")
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    first: dict[str, tuple[Path, int]] = {}
    for path in files:
        record = load(path)
        group, world = record["group"], record["world_size"]
        seen, size = first.setdefault(group, (path, world))
        if world != size:
            raise ValueError(
                f"{path}: world_size: {world}, where {seen.name} of the same group says {size}"
            )
        groups[group].append(record)
    return dict(groups)


def diagnose_dir(directory: str | Path) -> list[Diagnosis]:
    """A diagnosis per group of records in ``directory``, the latest last."""
    groups = read(directory)
    out = [diagnose(records) for records in groups.values()]
    out.sort(key=lambda d: d.gave_up_at or 0.0)
    return out


def diagnose(records: list[dict[str, Any]]) -> Diagnosis:
    """The verdict on the records of one group (see [Note: diagnosis])."""
    world = int(records[0]["world_size"])
    addresses = list(records[0].get("addresses") or [])
    # A rank that broke twice in one group (it should not) counts once: its first record.
    by_rank: dict[int, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: float(r["dumped_at"])):
        by_rank.setdefault(int(record["rank"]), record)

    # 1. The collective waited on: the lowest seq some rank had not finished.
    waited: dict[str, Any] | None = None
    for record in by_rank.values():
        for e in record["entries"]:
            if e["seq"] >= 0 and e["state"] in (RUNNING, WAITING):
                if waited is None or e["seq"] < waited["seq"]:
                    waited = e
                break
    seq = None if waited is None else int(waited["seq"])
    gave_up = min(float(r["dumped_at"]) for r in by_rank.values())

    # 2. Each rank against it.
    views = [
        _view(r, by_rank.get(r), seq, gave_up, addresses[r] if r < len(addresses) else "?")
        for r in range(world)
    ]

    # 3. The culprit.
    culprit, reason = _verdict(views, by_rank, seq, waited)
    return Diagnosis(
        group=str(records[0]["group"]),
        world_size=world,
        ranks_with_records=sorted(by_rank),
        op=None if waited is None else str(waited["op"]),
        seq=seq,
        nbytes=None if waited is None else int(waited["nbytes"]),
        path=None if waited is None else str(waited["path"] or "not started"),
        gave_up_at=gave_up,
        culprit=culprit,
        reason=reason,
        views=views,
    )


def _view(
    rank: int, record: dict[str, Any] | None, seq: int | None, gave_up: float, address: str
) -> RankView:
    if record is None:
        return RankView(rank, address, "no record", None, None, None, None, None)
    entries = [e for e in record["entries"] if e["seq"] >= 0]
    done = [e for e in entries if e["state"] == DONE]
    last = max(done, key=lambda e: e["ended"]) if done else None
    mine = next((e for e in entries if seq is not None and e["seq"] == seq), None)
    if seq is None:
        place = "in time"
    elif mine is None:
        place = "never reached"
    elif float(mine["called"]) > gave_up:
        place = "reached late"
    else:
        place = "in time"
    return RankView(
        rank,
        address,
        place,
        None if last is None else float(last["ended"]),
        None if last is None else f"{last['op']}#{last['seq']}",
        None if mine is None else float(mine["called"]),
        record.get("cause"),
        float(record["dumped_at"]),
    )


def _named(by_rank: dict[int, dict[str, Any]]) -> collections.Counter[int]:
    """How strongly the records' errors name each rank."""
    votes: collections.Counter[int] = collections.Counter()
    for rank, record in by_rank.items():
        cause = record.get("cause") or {}
        peer = cause.get("peer")
        if isinstance(peer, int) and peer != rank:
            votes[peer] += _WEIGHT.get(str(cause.get("evidence")), 1)
    return votes


def _verdict(
    views: list[RankView],
    by_rank: dict[int, dict[str, Any]],
    seq: int | None,
    waited: dict[str, Any] | None,
) -> tuple[int | None, str]:
    named = _named(by_rank)
    what = "the collective" if waited is None else f"{waited['op']}#{seq}"
    late = [v for v in views if v.place in ("never reached", "reached late")]
    missing = [v for v in views if v.place == "no record"]
    if late:
        # The first to stall: the oldest last sign of progress.
        first = min(
            late,
            key=lambda v: (v.last_progress if v.last_progress is not None else 0.0, -named[v.rank]),
        )
        if first.place == "never reached":
            why = f"it never reached {what}, which the others waited in"
        else:
            assert first.waiting_since is not None
            behind = first.waiting_since - min(v.dumped_at or 0.0 for v in views if v.dumped_at)
            why = f"it reached {what} only {behind:.1f} s after the others gave up on it"
        if first.last_done is not None:
            why += f" (its last finished collective: {first.last_done})"
        return first.rank, why
    if missing:
        chosen = max(missing, key=lambda v: (named[v.rank], -v.rank))
        why = (
            f"it left no flight record (its process died or is still stopped) while the "
            f"others waited in {what}"
        )
        if named[chosen.rank]:
            why += "; the others' errors name it"
        return chosen.rank, why
    if named:
        rank, _ = named.most_common(1)[0]
        return rank, f"every rank reached {what}; the ranks' errors name it"
    return None, f"every rank reached {what} and no error names a rank"


def render(diagnoses: Iterable[Diagnosis]) -> str:
    """The diagnoses as text, for a person."""
    lines: list[str] = []
    for d in diagnoses:
        lines.append(
            f"group {d.group}: world size {d.world_size}, flight records from ranks "
            f"{', '.join(map(str, d.ranks_with_records))}"
        )
        if d.seq is not None:
            lines.append(f"waited on: {d.op}#{d.seq} ({d.nbytes} bytes, {d.path})")
        if d.culprit is None:
            lines.append(f"culprit: none found: {d.reason}")
        else:
            address = d.views[d.culprit].address
            lines.append(f"culprit: rank {d.culprit} ({address}): {d.reason}")
        for v in d.views:
            lines.append(f"  rank {v.rank}: {_describe(v, d)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _describe(v: RankView, d: Diagnosis) -> str:
    if v.place == "no record":
        return "no flight record"
    parts = [v.place]
    if v.waiting_since is not None:
        parts.append(f"called {d.op}#{d.seq} at {_clock(v.waiting_since)}")
    if v.last_done is not None and v.last_progress is not None:
        parts.append(f"last finished {v.last_done} at {_clock(v.last_progress)}")
    if v.cause:
        peer = v.cause.get("peer")
        named = f" naming rank {peer}" if peer is not None else ""
        parts.append(f"broke with {v.cause.get('kind')}{named} ({v.cause.get('evidence')})")
    return "; ".join(parts)
