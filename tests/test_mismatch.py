"""Ranks that disagree get ProtocolError on every rank, naming both ranks and
both values, within the timeout; bad arguments fail before anything is sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

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
    # A refused call is still a collective: it takes its sequence number on
    # the refusing rank, and the other rank's matching call fails at once,
    # naming it (issue 17). No data moves, and the group stays in lock step.
    async with fg.testing.local_group(2, transport="memory") as peers:
        p, q = peers
        cases: list[tuple[type[Exception], str, Any, Any]] = [
            (
                fg.ConfigError,
                r"unsupported dtype torch\.complex64",
                lambda: p.all_reduce(torch.ones(3, dtype=torch.complex64)),
                lambda: q.all_reduce(torch.ones(3)),
            ),
            (
                TypeError,
                r"must be a torch\.Tensor",
                lambda: p.all_reduce([1, 2]),
                lambda: q.all_reduce(torch.ones(3)),
            ),
            (
                fg.ConfigError,
                r"root must be a rank in \[0, 2\), got 2",
                lambda: p.broadcast(torch.ones(3), 2),
                lambda: q.broadcast(torch.ones(3), 0),
            ),
            (
                fg.ConfigError,
                "expected world_size",
                lambda: p.all_gather_into_tensor(torch.empty(5), torch.ones(3)),
                lambda: q.all_gather_into_tensor(torch.empty(6), torch.ones(3)),
            ),
            (
                fg.ConfigError,
                "expected world_size",
                lambda: p.reduce_scatter_tensor(torch.empty(2), torch.ones(5)),
                lambda: q.reduce_scatter_tensor(torch.empty(2), torch.ones(4)),
            ),
            (
                fg.ConfigError,
                "out has dtype",
                lambda: p.all_gather_into_tensor(
                    torch.empty(6, dtype=torch.float64), torch.ones(3)
                ),
                lambda: q.all_gather_into_tensor(torch.empty(6), torch.ones(3)),
            ),
        ]
        for cls, message, bad, good in cases:
            with pytest.raises(cls, match=message):
                bad()
            with pytest.raises(fg.ConfigError, match=message) as info:
                await asyncio.wait_for(good(), 5)
            assert info.value.peer == 0 and "rank 0" in str(info.value), info.value
        # The group still works, in lock step.
        assert fg.testing.last_seq(p) == fg.testing.last_seq(q)
        ts = [torch.ones(3), torch.ones(3)]
        await asyncio.gather(*(r.all_reduce(t) for r, t in zip(peers, ts, strict=True)))
        assert ts[0].tolist() == [2.0, 2.0, 2.0]
        await p.close()
        with pytest.raises(fg.ConfigError, match="closed"):
            p.all_reduce(torch.ones(3))


async def test_checksum_algorithm_mismatch() -> None:
    from ferrogrpc.transport.integrity import crc32c

    async with fg.testing.local_group(2, timeouts=fg.Timeouts(collective=20, idle=10)) as peers:
        fg.testing.set_checksum(peers[1], crc32c)
        results = await asyncio.gather(
            *(p.all_reduce(torch.ones(8)) for p in peers), return_exceptions=True
        )
        for res in results:
            assert isinstance(res, fg.ProtocolError), res
            assert "checksum=crc32c" in str(res) and "checksum=crc32" in str(res), res


async def test_a_rank_of_another_ferrogrpc_version_is_named_as_such() -> None:
    # A rank whose streams speak another protocol (here: an older one,
    # which sends no protocol in its descriptors) fails every rank at once,
    # and the error says to run one version, not whichever other field the
    # versions also cut differently.
    from ferrogrpc.transport import wire

    def as_older(dst: int, message: bytes) -> bytes:
        header, payload = wire.decode(message)
        if not header.HasField("descriptor"):
            return message
        header.descriptor.protocol = 0
        header.descriptor.chunk_elems += 1
        return wire.encode(header, payload)

    calls: list[Call] = [lambda p: p.all_reduce(torch.ones(1 << 18))] * 3
    async with fg.testing.local_group(
        3, timeouts=fg.Timeouts(collective=20, idle=10, connect=10), direct=False
    ) as peers:
        peers[1]._ctx.transport.send_hook = as_older  # type: ignore[attr-defined]
        results = await asyncio.gather(
            *(calls[r](peers[r]) for r in range(3)), return_exceptions=True
        )
    for r, res in enumerate(results):
        assert isinstance(res, fg.ProtocolError), (r, res)
        assert "protocol" in str(res) and "run one version everywhere" in str(res), (r, res)


@pytest.mark.parametrize("numel", [4, 1 << 18])  # one exchange, and the ring
async def test_ranks_at_different_steps_never_mix_their_contributions(numel: int) -> None:
    # An elastic group stamps a step's collectives with its epoch and step
    # (ElasticBackend._stamp): members at two steps, same shapes otherwise,
    # fail the sync naming both steps (issue 61: a sync once mixed step 783
    # of trained members with step 0 of fresh processes).
    from ferrogrpc.algorithms.descriptor import make_stamp

    def at(step: int) -> Call:
        async def call(p: fg.Peer) -> object:
            p._set_stamp(make_stamp(7, step))
            return await p.all_reduce(torch.ones(numel, dtype=torch.float64))

        return call

    await _expect_protocol_error(
        3,
        [at(783), at(0), at(783)],
        "ranks disagree on stamp",
        "epoch 7 step 783",
        "epoch 7 step 0",
    )
