"""Ranks that disagree get ProtocolError on every rank, naming both ranks and
both values, within the timeout; bad arguments fail before anything is sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
import torch

import ferrogrpc as fg

pytestmark = pytest.mark.timeout(60)

Call = Callable[[fg.Peer], Awaitable[object]]


async def _expect_protocol_error(world: int, calls: list[Call], *needles: str) -> list[str]:
    async with fg.testing.local_group(
        world, timeouts=fg.Timeouts(collective=20, idle=10, connect=10)
    ) as peers:
        start = time.monotonic()
        results = await asyncio.gather(
            *(calls[r](peers[r]) for r in range(world)), return_exceptions=True
        )
        elapsed = time.monotonic() - start
        messages = []
        for r, res in enumerate(results):
            assert isinstance(res, fg.ProtocolError), f"rank {r} got {res!r}"
            assert res.rank == r
            text = str(res)
            for needle in needles:
                assert needle in text, f"rank {r}: {needle!r} not in {text!r}"
            messages.append(text)
        assert elapsed < 5, f"mismatch took {elapsed:.1f}s to detect"
        # The group is now broken: later collectives raise at once.
        with pytest.raises(fg.ProtocolError, match="broken by an earlier failure"):
            await peers[0].all_reduce(torch.ones(1))
        return messages


async def test_numel_mismatch() -> None:
    await _expect_protocol_error(
        3,
        [
            lambda p: p.all_reduce(torch.ones(10)),
            lambda p: p.all_reduce(torch.ones(12)),
            lambda p: p.all_reduce(torch.ones(10)),
        ],
        "numel=10",
        "numel=12",
        "rank 1",
    )


async def test_dtype_mismatch() -> None:
    await _expect_protocol_error(
        2,
        [
            lambda p: p.all_reduce(torch.ones(8)),
            lambda p: p.all_reduce(torch.ones(8, dtype=torch.float64)),
        ],
        "dtype=float32",
        "dtype=float64",
        "rank 0",
        "rank 1",
    )


async def test_reduce_op_mismatch() -> None:
    await _expect_protocol_error(
        2,
        [
            lambda p: p.all_reduce(torch.ones(8), "sum"),
            lambda p: p.all_reduce(torch.ones(8), "max"),
        ],
        "reduce_op=sum",
        "reduce_op=max",
    )


async def test_collective_kind_mismatch() -> None:
    await _expect_protocol_error(
        4,
        [
            lambda p: p.all_reduce(torch.ones(8)),
            lambda p: p.all_reduce(torch.ones(8)),
            lambda p: p.broadcast(torch.ones(8), 0),
            lambda p: p.all_reduce(torch.ones(8)),
        ],
        "kind=all_reduce",
        "kind=broadcast",
    )


async def test_broadcast_root_mismatch() -> None:
    await _expect_protocol_error(
        2,
        [lambda p: p.broadcast(torch.ones(8), 0), lambda p: p.broadcast(torch.ones(8), 1)],
        "root=0",
        "root=1",
    )


async def test_bad_arguments_raise_before_sending() -> None:
    async with fg.testing.local_group(2, transport="memory") as peers:
        p = peers[0]
        with pytest.raises(fg.ConfigError, match=r"unsupported dtype torch\.uint8"):
            p.all_reduce(torch.ones(3, dtype=torch.uint8))
        with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
            p.all_reduce([1, 2])  # type: ignore[arg-type]
        with pytest.raises(fg.ConfigError, match=r"root must be a rank in \[0, 2\), got 2"):
            p.broadcast(torch.ones(3), 2)
        with pytest.raises(fg.ConfigError, match="expected world_size"):
            p.all_gather_into_tensor(torch.empty(5), torch.ones(3))
        with pytest.raises(fg.ConfigError, match="expected world_size"):
            p.reduce_scatter_tensor(torch.empty(2), torch.ones(5))
        with pytest.raises(fg.ConfigError, match="out has dtype"):
            p.all_gather_into_tensor(torch.empty(6, dtype=torch.float64), torch.ones(3))
        # Nothing was sent: the group still works, in lock step.
        ts = [torch.ones(3), torch.ones(3)]
        await asyncio.gather(*(q.all_reduce(t) for q, t in zip(peers, ts, strict=True)))
        assert ts[0].tolist() == [2.0, 2.0, 2.0]
        await p.close()
        with pytest.raises(fg.ConfigError, match="closed"):
            p.all_reduce(torch.ones(3))


async def test_checksum_algorithm_mismatch() -> None:
    from ferrogrpc.integrity import crc32c

    async with fg.testing.local_group(2, timeouts=fg.Timeouts(collective=20, idle=10)) as peers:
        peers[1].checksum = crc32c
        results = await asyncio.gather(
            *(p.all_reduce(torch.ones(8)) for p in peers), return_exceptions=True
        )
        for res in results:
            assert isinstance(res, fg.ProtocolError), res
            assert "checksum=crc32c" in str(res) and "checksum=crc32" in str(res), res
