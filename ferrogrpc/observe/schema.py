"""Reading JSON that another process wrote (a flight record, a trace), as
hostile: bounded before it is read, and every field checked for its type
and range before it is used.

[Note: records read as hostile]
``ferrogrpc diagnose`` and ``ferrogrpc trace merge`` read files from a
directory that other ranks, or other users, wrote. A file may be truncated,
from another program, or made to hurt: a ``world_size`` of two billion
(``diagnose`` would build a view per rank), a list of a billion entries,
JSON nested ten thousand deep (``json.loads`` recurses), NaN where a time
belongs. So a file is read only if it is a regular file under a size cap
(opened without blocking: a FIFO cannot stall the reader), parsed with
NaN and Infinity refused and deep nesting caught, and each field the
readers use is checked here (:class:`Fields`). Every failure is one
:class:`SchemaError` naming the field, which the reader reports as one line
naming the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

# The most ranks a record may claim (the coordinator's own cap is lower).
MAX_WORLD_SIZE = 65536
# A string field's longest (an error's message is the longest written).
MAX_STR = 64 << 10
# Containers nested deeper than this are refused (the writers nest three).
MAX_DEPTH = 32


class SchemaError(ValueError):
    """A file that is not what its reader expects; the message names the
    field (``entries[3].seq``) and what is wrong with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field or 'the top level'}: {problem}")
        self.field = field


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _NotFiniteError(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    raise _NotFiniteError(f"{name} where a number belongs (a record holds finite numbers only)")


def read_json(path: Path, limit: int, what: str) -> Any:
    """The JSON value in the file ``path``, at most ``limit`` bytes; a
    ValueError, ``PATH: not a readable WHAT (why)``, for anything else (see
    [Note: records read as hostile])."""

    def unreadable(why: str) -> ValueError:
        return ValueError(f"{path}: not a readable {what} ({why})")

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise unreadable(str(exc.strerror)) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise unreadable("not a regular file")
        if st.st_size > limit:
            raise unreadable(f"{st.st_size} bytes, more than the {limit} one may have")
        try:
            raw = f.read(limit + 1)
        except OSError as exc:
            raise unreadable(str(exc.strerror)) from None
    if len(raw) > limit:
        raise unreadable(f"more than the {limit} bytes one may have")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise unreadable(f"not UTF-8 text: byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise unreadable(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise unreadable("JSON nested too deeply") from None
    except ValueError as exc:  # NaN, or an integer of more digits than Python converts
        raise unreadable(str(exc).splitlines()[0]) from None


def check_depth(value: object, field: str, depth: int = MAX_DEPTH) -> None:
    """SchemaError if ``value`` nests containers deeper than ``depth``."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if level >= depth:
            raise SchemaError(field, f"nested more than {depth} deep")
        stack.extend((child, level + 1) for child in children)


def integer(value: object, field: str, low: int, high: int) -> int:
    """``value`` as an integer from ``low`` to ``high``, both included."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(field, f"an integer expected, not {_kind(value)} ({_shown(value)})")
    if not low <= value <= high:
        raise SchemaError(field, f"{_shown(value)} is out of range ({low} to {high})")
    return value


def number(value: object, field: str) -> float:
    """``value`` as a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(field, f"a number expected, not {_kind(value)} ({_shown(value)})")
    result = float(value)
    if not math.isfinite(result):
        raise SchemaError(field, f"{_shown(value)} is not a finite number")
    return result


def string(value: object, field: str, limit: int = MAX_STR) -> str:
    """``value`` as a string of at most ``limit`` characters."""
    if not isinstance(value, str):
        raise SchemaError(field, f"a string expected, not {_kind(value)} ({_shown(value)})")
    if len(value) > limit:
        raise SchemaError(field, f"a string of {len(value)} characters, more than {limit}")
    return value


def array(value: object, field: str, limit: int) -> list[Any]:
    """``value`` as a list of at most ``limit`` items."""
    if not isinstance(value, list):
        raise SchemaError(field, f"a list expected, not {_kind(value)} ({_shown(value)})")
    if len(value) > limit:
        raise SchemaError(field, f"a list of {len(value)} items, more than {limit}")
    return value


class Fields:
    """One JSON object's fields, each checked as it is taken; ``where`` is
    the object's own field name (empty at the top level)."""

    def __init__(self, value: object, where: str = "") -> None:
        if not isinstance(value, dict):
            raise SchemaError(where, f"an object expected, not {_kind(value)} ({_shown(value)})")
        self.data: dict[str, Any] = value
        self.where = where

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def has(self, key: str) -> bool:
        """Whether ``key`` is there and not null."""
        return self.data.get(key) is not None

    def raw(self, key: str) -> Any:
        if key not in self.data:
            raise SchemaError(self.name(key), "missing")
        return self.data[key]

    def integer(self, key: str, low: int, high: int) -> int:
        return integer(self.raw(key), self.name(key), low, high)

    def number(self, key: str) -> float:
        return number(self.raw(key), self.name(key))

    def string(self, key: str, limit: int = MAX_STR) -> str:
        return string(self.raw(key), self.name(key), limit)

    def array(self, key: str, limit: int) -> list[Any]:
        return array(self.raw(key), self.name(key), limit)

    def object(self, key: str) -> Fields:
        return Fields(self.raw(key), self.name(key))

    def boolean(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise SchemaError(self.name(key), f"true or false expected, not {_kind(value)}")
        return value

    # Optional fields: missing or null is None.

    def maybe_integer(self, key: str, low: int, high: int) -> int | None:
        return self.integer(key, low, high) if self.has(key) else None

    def maybe_number(self, key: str) -> float | None:
        return self.number(key) if self.has(key) else None

    def maybe_string(self, key: str, limit: int = MAX_STR) -> str | None:
        return self.string(key, limit) if self.has(key) else None

    def maybe_object(self, key: str) -> Fields | None:
        return self.object(key) if self.has(key) else None
