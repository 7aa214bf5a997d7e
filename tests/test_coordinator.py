"""The coordinator in-process: rank assignment, frozen round answers with the
session nonces, freed slots, elastic sizing; and a taken port is a clean error."""

from __future__ import annotations

import asyncio
import socket

import pytest

import ferrogrpc as fg
from ferrogrpc.coordinator import Coordinator, CoordinatorRendezvous
from ferrogrpc.transport import GrpcTransport

pytestmark = pytest.mark.timeout(60)


async def test_rounds_answer_ranks_tables_and_nonces() -> None:
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    try:
        target = f"127.0.0.1:{port}"
        a, b = CoordinatorRendezvous(target, timeout=10), CoordinatorRendezvous(target, timeout=10)
        ra, rb = await asyncio.gather(
            a.exchange(None, None, "host-a:1", "nonce-a"),
            b.exchange(None, 2, "host-b:2", "nonce-b"),
        )
        assert {ra.rank, rb.rank} == {0, 1} and ra.world_size == rb.world_size == 2
        assert ra.addresses == rb.addresses and ra.nonces == rb.nonces
        assert ra.nonces[ra.rank] == "nonce-a" and ra.nonces[rb.rank] == "nonce-b"
        # A new peer after completion starts a new round; the old answers stay.
        c = CoordinatorRendezvous(target, timeout=1)
        with pytest.raises(fg.RendezvousError):
            await c.exchange(None, None, "host-c:3", "nonce-c")
        await asyncio.gather(a.close(), b.close(), c.close())
    finally:
        await coordinator.stop(0)


async def test_a_joiner_that_gives_up_frees_its_slot() -> None:
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    try:
        target = f"127.0.0.1:{port}"
        quitter = CoordinatorRendezvous(target, timeout=1)
        with pytest.raises(fg.RendezvousError):
            await quitter.exchange(None, None, "dead:1", "n0")
        await asyncio.sleep(0.2)
        a, b = CoordinatorRendezvous(target, timeout=10), CoordinatorRendezvous(target, timeout=10)
        ra, _ = await asyncio.gather(
            a.exchange(None, None, "live-a:1", "na"), b.exchange(None, None, "live-b:2", "nb")
        )
        assert "dead:1" not in ra.addresses, ra.addresses
        await asyncio.gather(a.close(), b.close(), quitter.close())
    finally:
        await coordinator.stop(0)


async def test_elastic_round_is_sized_by_who_joined() -> None:
    coordinator = Coordinator(0, min_ranks=2, join_window=0.5)
    port = await coordinator.start("127.0.0.1:0")
    try:
        target = f"127.0.0.1:{port}"
        joiners = [CoordinatorRendezvous(target, timeout=10) for _ in range(3)]
        results = await asyncio.gather(
            *(j.exchange(None, None, f"h{i}:1", f"n{i}") for i, j in enumerate(joiners))
        )
        assert sorted(r.rank for r in results) == [0, 1, 2]
        assert all(r.world_size == 3 for r in results)
        await asyncio.gather(*(j.close() for j in joiners))
    finally:
        await coordinator.stop(0)


async def test_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        transport = GrpcTransport(f"127.0.0.1:{port}")
        with pytest.raises(fg.ConfigError, match=f"127.0.0.1:{port}"):
            await transport.start(None)  # type: ignore[arg-type]


def test_a_group_that_never_forms_is_a_rendezvous_error() -> None:
    import threading
    import time

    from tests.helpers import free_port

    before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(fg.RendezvousError, match="within"):
        fg.init_backend(
            0, 2, "127.0.0.1", free_port(), timeouts=fg.Timeouts(collective=5, idle=5, connect=2)
        )
    assert time.monotonic() - start < 15
    time.sleep(0.5)
    assert threading.active_count() <= before + 1  # at most the store's executor thread


async def test_a_late_neighbour_that_answers_pings_is_waited_for() -> None:
    import torch

    timeouts = fg.Timeouts(collective=20, idle=0.3, connect=10)
    async with fg.testing.local_group(3, timeouts=timeouts) as peers:
        ts = [torch.ones(1000) * (r + 1) for r in range(3)]

        async def late(p: fg.Peer, t: torch.Tensor) -> torch.Tensor:
            await asyncio.sleep(1.5)  # five idle timeouts of rank-local work
            return await p.all_reduce(t)

        await asyncio.gather(
            peers[0].all_reduce(ts[0]), peers[1].all_reduce(ts[1]), late(peers[2], ts[2])
        )
        assert all(bool(t.eq(6.0).all()) for t in ts)
