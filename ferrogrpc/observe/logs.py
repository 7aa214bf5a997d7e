"""Structured logs: every line a rank writes says which rank, and where it
concerns a collective, which op and seq (and the peer it names).

[Note: logs]
The library logs through ``logging`` under the ``"ferrogrpc"`` logger and
installs no handler of its own unless asked: a healthy run prints nothing
(its lines are INFO and DEBUG; Python prints only WARNING and above when an
application configured nothing, and a healthy run writes none).

Each line carries its fields as attributes of the record (``rank``,
``world_size``, ``op``, ``seq``, ``peer``), so any formatter can use them;
:class:`JsonFormatter` writes one JSON object per line with them.
``FERROGRPC_LOG=json`` (or ``text``) installs one handler on the
``"ferrogrpc"`` logger at ``FERROGRPC_LOG_LEVEL`` (default INFO): see
:func:`configure`. At DEBUG, every collective writes one line when it ends
(op, seq, path, bytes, milliseconds); below DEBUG that sink is not attached
at all, so it costs nothing.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import IO, Any

from ..errors import FerroGrpcError, Identity
from .flight import Entry

LOGGER = "ferrogrpc"
# The record attributes a line may carry, in the order the formatters print them.
FIELDS = ("rank", "world_size", "op", "seq", "peer")
FORMATS = ("json", "text")

# The handler configure() installed, so that a second call replaces it.
_installed: logging.Handler | None = None


class RankLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger for one rank: its rank and world size on every line, with
    the ``extra`` of each call (op, seq, peer) laid over them."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        merged = dict(self.extra or {})
        merged.update(kwargs.get("extra") or {})
        kwargs["extra"] = merged
        return msg, kwargs


def for_rank(identity: Identity, name: str = LOGGER) -> RankLog:
    """The logger ``name`` for the rank ``identity`` names."""
    return RankLog(
        logging.getLogger(name), {"rank": identity.rank, "world_size": identity.world_size}
    )


def error_fields(err: FerroGrpcError) -> dict[str, Any]:
    """An error's op, seq and peer, as a line's fields."""
    return {"op": err.op, "seq": err.seq, "peer": err.peer}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(record, name, None)
        if value is not None:
            out[name] = value
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger,
    message, the fields a line carries (rank, world_size, op, seq, peer),
    and the exception, if any."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, Any] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger [rank 2/4 all_reduce#17 peer 1] message``."""

    def format(self, record: logging.LogRecord) -> str:
        f = _fields(record)
        where = []
        if "rank" in f:
            where.append(f"rank {f['rank']}/{f.get('world_size', '?')}")
        if "op" in f:
            where.append(f"{f['op']}#{f.get('seq', '?')}")
        if "peer" in f:
            where.append(f"peer {f['peer']}")
        prefix = f"[{' '.join(where)}] " if where else ""
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp}.{int(record.msecs):03d} {record.levelname} {record.name} {prefix}"
        text += record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure(
    fmt: str = "json", level: str | int = "INFO", stream: IO[str] | None = None
) -> logging.Handler:
    """Send the ``"ferrogrpc"`` logger's lines to ``stream`` (default
    stderr) as ``fmt`` (``"json"`` or ``"text"``) from ``level`` up. A
    second call replaces the first one's handler. ValueError names a bad
    format or level."""
    global _installed
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    logger = logging.getLogger(LOGGER)
    if _installed is not None:
        logger.removeHandler(_installed)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(numeric)
    _installed = handler
    return handler


def configure_once(fmt: str | None, level: str | None) -> None:
    """:func:`configure` as ``FERROGRPC_LOG`` (``fmt``) and
    ``FERROGRPC_LOG_LEVEL`` (``level``) ask, once per process for the same
    values; nothing when ``fmt`` is None (the application's own logging
    configuration stands)."""
    if not fmt:
        return
    key = (fmt, level or "INFO")
    if _installed is not None and getattr(_installed, "_ferrogrpc_key", None) == key:
        return
    handler = configure(*key)
    handler._ferrogrpc_key = key  # type: ignore[attr-defined]


def collective_line(log: RankLog) -> Callable[[Entry], None]:
    """A collective sink writing one DEBUG line per collective that ends."""

    def line(entry: Entry) -> None:
        ms = (entry.ended - entry.called) * 1e3
        fields = {"op": entry.op, "seq": entry.seq, "peer": entry.culprit}
        log.debug(
            "%s#%d %s in %.3f ms (%s, %d bytes)",
            entry.op,
            entry.seq,
            entry.state,
            ms,
            entry.path,
            entry.nbytes,
            extra=fields,
        )

    return line
