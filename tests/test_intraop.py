"""The backend's loop thread runs torch ops single-threaded; nothing else changes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

import ferrogrpc as fg
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _loop_thread_count(backend: fg.Backend) -> int:
    async def probe() -> int:
        return torch.get_num_threads()

    return asyncio.run_coroutine_threadsafe(probe(), backend._loop).result(10)


def _solo() -> fg.Backend:
    return fg.init_backend(0, 1, "127.0.0.1", free_port())


def test_loop_thread_is_single_threaded_and_main_thread_keeps_its_setting(
    two_threads: None,
) -> None:
    backend = _solo()
    try:
        assert _loop_thread_count(backend) == 1
        assert torch.get_num_threads() == 2
        t = torch.arange(1 << 20, dtype=torch.float32)
        backend.all_reduce(t)
        assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))
    finally:
        backend.close()
    # A later thread still starts from torch's own setting.
    assert torch.get_num_threads() == 2


def test_env_sets_the_count_and_zero_leaves_torch_alone(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(3)
    for value, expected in (("2", 2), ("0", 3), ("1", 1)):
        monkeypatch.setenv("FERROGRPC_REDUCE_THREADS", value)
        backend = _solo()
        try:
            assert _loop_thread_count(backend) == expected
        finally:
            backend.close()


@pytest.mark.parametrize("value", ["two", "-1"])
def test_malformed_env_is_a_config_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERROGRPC_REDUCE_THREADS", value)
    with pytest.raises(fg.ConfigError, match="FERROGRPC_REDUCE_THREADS"):
        _solo()
