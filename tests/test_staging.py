"""Device staging, tested on the CPU: a lazy copier stands in for CUDA copy
streams. Copies complete only when waited on (in issue order), and the host
buffer starts full of NaN, so any read of a range before its device-to-host
copy finished, or any result not copied back, shows up as a wrong answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms.staging import Copier, PinnedPool, Stage, host_view
from ferrogrpc.errors import Identity
from ferrogrpc.runtime.placement import Placement
from tests.helpers import reference_sum

pytestmark = pytest.mark.timeout(120)


class LazyCopier(Copier):
    """Queues copies; performs them in order only when a ticket is waited on
    (or published), after yielding to the loop, like an asynchronous engine."""

    log: list[str]

    def __init__(self, log: list[str]) -> None:
        self.queue: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.issued = 0
        self.completed = 0
        self.log = log
        self.user_work: list[Callable[[], object]] = []

    def begin(self) -> None:
        self.log.append("begin")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self.issued += 1
        self.queue.append((self.issued, dst, src))
        return self.issued

    def _drain(self, upto: int) -> None:
        while self.queue and self.queue[0][0] <= upto:
            _, dst, src = self.queue.pop(0)
            dst.copy_(src)
            self.completed += 1

    async def wait(self, ticket: Any) -> None:
        await asyncio.sleep(0)
        self._drain(int(ticket))

    def publish(self) -> Any:
        self.log.append("publish")
        return self.issued

    def then(self, fn: Callable[[], object]) -> None:
        self._drain(self.issued)
        fn()


class NanPool(PinnedPool):
    def acquire(self, nbytes: int) -> torch.Tensor:
        buf = super().acquire(nbytes)
        buf.fill_(0xFF)  # NaN for floats, -1 for ints
        return buf


def _stage_everything(world: int) -> tuple[Callable[[Identity], Placement], list[list[str]]]:
    """A placement that stages every tensor through a LazyCopier and a
    NaN-filled pool, and each rank's copier log."""
    logs: list[list[str]] = [[] for _ in range(world)]

    def make(me: Identity) -> Placement:
        log = logs[me.rank]
        return Placement(me, copier_factory=lambda t: LazyCopier(log), pool=NanPool(pin=False))

    return make, logs


@pytest.mark.parametrize("world", [2, 3])
async def test_staged_collectives_match_the_reference(world: int) -> None:
    policy = fg.ChunkPolicy(chunk_bytes=256, max_lanes=2, lane_min_bytes=1024)
    placement, logs = _stage_everything(world)
    async with fg.testing.local_group(world, chunk_policy=policy, placement=placement) as peers:
        for numel in (1, 7, 1000, 4099):
            inputs = [
                torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
                for r in range(world)
            ]
            ref = reference_sum(inputs)
            ts = [t.clone() for t in inputs]
            await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, ts, strict=True)))
            for t in ts:
                torch.testing.assert_close(t, ref)
            ts = [t.clone() for t in inputs]
            await asyncio.gather(*(p.all_reduce(t, "mean") for p, t in zip(peers, ts, strict=True)))
            for t in ts:
                torch.testing.assert_close(t, ref / world)
            ts = [t.clone() for t in inputs]
            await asyncio.gather(
                *(p.broadcast(t, world - 1) for p, t in zip(peers, ts, strict=True))
            )
            for t in ts:
                assert torch.equal(t, inputs[world - 1])
            outs = [torch.full((world * numel,), 7.0, dtype=torch.float64) for _ in range(world)]
            await asyncio.gather(
                *(
                    p.all_gather_into_tensor(o, t)
                    for p, o, t in zip(peers, outs, inputs, strict=True)
                )
            )
            for o in outs:
                assert torch.equal(o, torch.cat(inputs))
            parts = await asyncio.gather(
                *(p.reduce_scatter(t) for p, t in zip(peers, inputs, strict=True))
            )
            for r, part in enumerate(parts):
                torch.testing.assert_close(part, torch.tensor_split(ref, world)[r])
        # Non-contiguous tensors are staged through a contiguous copy.
        bases = [torch.arange(12.0).reshape(3, 4) * (r + 1) for r in range(world)]
        await asyncio.gather(*(p.all_reduce(b.t()) for p, b in zip(peers, bases, strict=True)))
        for b in bases:
            torch.testing.assert_close(
                b, torch.arange(12.0).reshape(3, 4) * sum(range(1, world + 1))
            )
        for log in logs:
            assert log.count("begin") == log.count("publish") > 0


async def test_stage_waits_only_for_the_chunks_it_touches() -> None:
    log: list[str] = []
    copier = LazyCopier(log)
    device = torch.arange(10.0)
    raw = NanPool(pin=False).acquire(10 * 4)
    host = host_view(raw, torch.float32, 10)
    stage = Stage(
        copier,
        PinnedPool(pin=False),
        host,
        load=device,
        load_at=0,
        store=device,
        result=host,
        store_at=0,
        chunk_elems=4,
        release=[raw],
    )
    assert copier.completed == 0 and torch.isnan(host).all()
    await stage.ready(0, 3)  # only the first chunk
    assert (
        copier.completed == 1 and torch.equal(host[:4], device[:4]) and torch.isnan(host[4:]).all()
    )
    await stage.ready(5, 6)  # the second chunk, in issue order
    assert copier.completed == 2
    await stage.ready(0, 8)  # nothing new to wait for
    assert copier.completed == 2
    host[0:4] += 100
    stage.final(0, 4)  # queued, not yet on the "device"
    assert device[0].item() == 0.0
    await stage.finish()
    assert device[:4].tolist() == [100.0, 101.0, 102.0, 103.0]
    assert log == ["begin", "publish"]


def test_pinned_pool_reuses_buffers() -> None:
    pool = PinnedPool(pin=False)
    a = pool.acquire(5000)
    assert a.numel() == 8192
    pool.release(a)
    assert pool.acquire(6000) is a
    assert pool.acquire(6000) is not a
