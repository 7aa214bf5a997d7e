"""Load: 2,000 small collectives back to back plus 64 in flight at once
across 4 ranks, all results checked; RSS and open descriptors stay flat."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import pytest
import torch

import ferrogrpc as fg

RSS_MARGIN = 48 << 20  # bytes
FD_MARGIN = 8


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _round(peers: list[fg.Peer], i: int) -> None:
    n = len(peers)
    kind = i % 4
    if kind == 0:
        ts = [torch.full((17,), float(r + i)) for r in range(n)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, ts, strict=True)))
        expected = sum(float(r + i) for r in range(n))
        assert all(bool(t.eq(expected).all()) for t in ts), i
    elif kind == 1:
        ts = [torch.full((5,), float(r)) for r in range(n)]
        await asyncio.gather(*(p.broadcast(t, i % n) for p, t in zip(peers, ts, strict=True)))
        assert all(bool(t.eq(float(i % n)).all()) for t in ts), i
    elif kind == 2:
        outs = await asyncio.gather(
            *(p.all_gather(torch.tensor([r, i])) for r, p in enumerate(peers))
        )
        assert all(torch.equal(o[r], torch.tensor([r, i])) for o in outs for r in range(n)), i
    else:
        await asyncio.gather(*(p.barrier() for p in peers))


@pytest.mark.timeout(180)
async def test_two_thousand_collectives_and_sixty_four_in_flight(
    report: Callable[[str], None],
) -> None:
    async with fg.testing.local_group(4) as peers:
        for i in range(200):  # warm up: connections, allocator, caches
            await _round(peers, i)
        rss0, fds0 = fg.testing.rss(), _fds()
        start = time.monotonic()
        for i in range(200, 2000):
            await _round(peers, i)
        serial = time.monotonic() - start
        # 64 all_reduces in flight at once from every rank.
        inputs = [[torch.full((100 + k,), float(r * 100 + k)) for k in range(64)] for r in range(4)]
        await asyncio.gather(*(peers[r].all_reduce(t) for r in range(4) for t in inputs[r]))
        for k in range(64):
            expected = sum(float(r * 100 + k) for r in range(4))
            for r in range(4):
                assert bool(inputs[r][k].eq(expected).all()), (r, k)
        rss1, fds1 = fg.testing.rss(), _fds()
        report(
            f"load: 1800 collectives in {serial:.2f}s ({serial / 1800 * 1e3:.2f} ms each, 4 ranks "
            f"in one loop); RSS {rss0 >> 20} -> {rss1 >> 20} MiB, fds {fds0} -> {fds1}"
        )
        assert rss1 - rss0 < RSS_MARGIN, (rss0, rss1)
        assert fds1 - fds0 <= FD_MARGIN, (fds0, fds1)
