"""Point-to-point messages on the asyncio API: send and recv match in call
order per (sender, tag), and a receive from any source takes each rank's
messages in order and names the sender."""

from __future__ import annotations

import asyncio

import pytest
import torch

import ferrogrpc as fg

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["grpc", "memory"])
async def test_send_and_recv_match_by_order_and_tag(transport: str) -> None:
    async with fg.testing.local_group(2, transport=transport) as peers:  # type: ignore[arg-type]
        a, b = peers
        sends = [
            a.send(torch.full((5,), 1.0), 1, tag=7),
            a.send(torch.full((5,), 2.0), 1, tag=0),
            a.send(torch.full((5,), 3.0), 1, tag=7),
        ]
        got = [torch.zeros(5) for _ in range(3)]
        recvs = [b.recv(got[0], 0, tag=0), b.recv(got[1], 0, tag=7), b.recv(got[2], 0, tag=7)]
        await asyncio.gather(*sends, *recvs)
        assert [g[0].item() for g in got] == [2.0, 1.0, 3.0]


@pytest.mark.parametrize("transport", ["grpc", "memory"])
async def test_recv_any_names_each_sender_and_keeps_each_ranks_order(transport: str) -> None:
    async with fg.testing.local_group(3, transport=transport) as peers:  # type: ignore[arg-type]
        # Ranks 1 and 2 each send two messages to rank 0: value 10*rank + i.
        sends = [
            peers[r].send(torch.full((3,), float(10 * r + i)), 0) for r in (1, 2) for i in range(2)
        ]
        outs = [torch.zeros(3) for _ in range(4)]
        senders = await asyncio.gather(*(peers[0].recv_any(t) for t in outs), *sends)
        seen: dict[int, list[float]] = {1: [], 2: []}
        for sender, t in zip(senders[:4], outs, strict=True):
            assert t.eq(t[0]).all()
            assert int(t[0].item()) // 10 == sender, (sender, t)
            seen[sender].append(t[0].item())
        # Every message once, and each rank's in its order.
        assert seen == {1: [10.0, 11.0], 2: [20.0, 21.0]}, seen


async def test_a_named_recv_called_meanwhile_takes_its_message_first() -> None:
    async with fg.testing.local_group(3) as peers:
        anyone = torch.zeros(2)
        named = torch.zeros(2)
        waiting = asyncio.ensure_future(peers[0].recv_any(anyone))
        await asyncio.sleep(0.05)
        from_one = asyncio.ensure_future(peers[0].recv(named, 1))
        await peers[1].send(torch.full((2,), 1.0), 0)
        await from_one
        assert named.tolist() == [1.0, 1.0] and not waiting.done()
        await peers[2].send(torch.full((2,), 2.0), 0)
        assert await waiting == 2 and anyone.tolist() == [2.0, 2.0]
