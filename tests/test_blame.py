"""Whom a failure names, on the paths where the cause could be lost: a call
on a rank that an earlier failure broke, a two-level collective that fails
across hosts (the host's other ranks are told through shared memory), and a
direct wait whose peer's socket ends just before its report lands."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms.exchange_plan import SMALL_BYTES
from ferrogrpc.samehost.plane import LocalPlane
from ferrogrpc.testing import Fault, FaultKind
from ferrogrpc.v1 import collective_pb2 as pb

from .helpers import async_wait_until

pytestmark = pytest.mark.timeout(60)

LARGE = SMALL_BYTES // 4 + 1000  # past the one-exchange bound: a ring


async def test_a_call_on_a_broken_rank_still_names_the_culprit() -> None:
    async with fg.testing.local_group(2) as peers:
        running = asyncio.ensure_future(peers[0].all_reduce(torch.ones(4 * LARGE)))
        await asyncio.sleep(0.05)
        await peers[1].close()
        with pytest.raises(fg.PeerError) as first:
            await running
        assert first.value.peer == 1, first.value
        with pytest.raises(fg.PeerError) as later:
            await peers[0].all_reduce(torch.ones(4))
        assert "broken by an earlier failure" in str(later.value), later.value
        assert later.value.peer == 1 and "peer 1" in str(later.value), later.value


async def test_a_two_level_failure_across_hosts_is_told_through_shared_memory() -> None:
    # 2x2: rank 2 corrupts what it sends across hosts; rank 0 finds it, and
    # tells its own host's other rank through the same-host plane at once.
    hosts = ["a", "a", "b", "b"]
    fault = Fault(rank=2, kind=FaultKind.CORRUPT_PAYLOAD, nth=1, collective="all_reduce")
    async with fg.testing.local_group(4, transport="shm", hosts=hosts, faults=[fault]) as peers:
        results = await asyncio.gather(
            *(p.all_reduce(torch.ones(LARGE)) for p in peers), return_exceptions=True
        )
        for r, res in enumerate(results):
            assert isinstance(res, fg.FerroGrpcError), (r, res)
            assert res.peer == 2, (r, res)
        # Every host's plane heard why, not only gRPC. A rank whose own
        # failure was a symptom (rank 2, when rank 0's stream ended without
        # its end markers) tells its host that at once, and the cause once
        # rank 0's report reaches it: give that a moment.
        for r in (0, 1, 3):
            plane = peers[r]._plane
            assert plane is not None

            def heard(plane: LocalPlane = plane) -> bool:
                return plane.failed is not None and plane.failed.peer == 2

            try:
                await async_wait_until(heard, 3.0, f"rank {r}'s plane to hear rank 2 named")
            except AssertionError:
                raise AssertionError((r, plane.failed)) from None


async def test_a_direct_wait_gives_a_gone_peers_late_report_a_moment_to_land() -> None:
    async with fg.testing.local_group(2, transport="shm") as peers:
        waiting = asyncio.ensure_future(peers[0].all_reduce(torch.ones(4)))
        await asyncio.sleep(0.3)  # rank 0 waits on its direct socket for rank 1
        seq = fg.testing.last_seq(peers[0])
        plane = peers[1]._plane
        assert plane is not None
        direct = plane.links[0].direct
        assert direct is not None
        direct.shutdown(socket.SHUT_RDWR)  # rank 1's process ends...
        await asyncio.sleep(0.05)
        plane.abort(  # ...and its report of why lands a moment later
            pb.Abort(
                seq=seq,
                from_rank=1,
                error="ProtocolError",
                message="the real cause",
                culprit=1,
            )
        )
        with pytest.raises(fg.ProtocolError) as info:
            await waiting
        assert "the real cause" in str(info.value), info.value
