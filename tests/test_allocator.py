"""ferrogrpc's glibc allocator tuning (runtime/allocator.py): what it sets
when a backend starts, and that a setting the user made in glibc's own
variables is kept."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from ferrogrpc.env import Settings
from ferrogrpc.runtime import allocator

pytestmark = pytest.mark.timeout(30)

MMAP, TRIM, ARENAS = -3, -1, -8  # glibc's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_ARENA_MAX


class _Libc:
    """Stands in for libc: records each mallopt(option, value)."""

    def __init__(self, calls: list[tuple[int, int]]) -> None:
        self.calls = calls

        def mallopt(option: int, value: int) -> int:
            calls.append((option, value))
            return 1

        self.mallopt: Any = mallopt


def _applied(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[int, int]:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(allocator, "_done", False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Libc(calls))
    assert allocator.tune_for(Settings.from_env(env)) == bool(calls)
    return dict(calls)


def test_the_tuning_keeps_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    tuned = {MMAP: 64 << 20, TRIM: 256 << 20, ARENAS: 1}
    assert _applied(monkeypatch, {}) == tuned
    assert _applied(monkeypatch, {"FERROGRPC_MALLOC_TUNING": "0"}) == {}
    # glibc read the user's own variables at start: they are not overridden.
    mine = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20)}
    assert _applied(monkeypatch, mine) == {TRIM: 256 << 20, ARENAS: 1}
    mine = {"MALLOC_TRIM_THRESHOLD_": "1", "MALLOC_ARENA_MAX": "4"}
    assert _applied(monkeypatch, mine) == {MMAP: 64 << 20}
    tunables = "glibc.malloc.mmap_threshold=9:glibc.malloc.trim_threshold=9"
    assert _applied(monkeypatch, {"GLIBC_TUNABLES": tunables}) == {ARENAS: 1}
    tunables = "glibc.malloc.arena_max=2"
    assert _applied(monkeypatch, {"GLIBC_TUNABLES": tunables}) == {MMAP: 64 << 20, TRIM: 256 << 20}
