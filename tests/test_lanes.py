"""Long-lived lanes (issue 31, item 5; [Note: long-lived lanes] in
transport/grpc_streams.py): ring collectives reuse one Lane RPC per
neighbour and lane instead of an RPC each; a stream the receiver fails
takes only its own lane down, and the next collective runs on a new one;
an outsider's Lane gets answers, never a hang or an escaped exception.
Every result is checked against a float64 sum of the inputs."""

from __future__ import annotations

import asyncio
import gc
import sys
from typing import Any

import grpc
import grpc.aio
import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms import ring as lane
from ferrogrpc.transport import grpc_streams, wire
from ferrogrpc.transport.grpc_streams import LANE_METHOD, TOKEN_METADATA_KEY
from ferrogrpc.transport.streams import Replayed
from ferrogrpc.v1 import collective_pb2 as pb
from tests.helpers import reference_sum

pytestmark = pytest.mark.timeout(90)

FAST = fg.Timeouts(collective=30, idle=10, connect=10)
N = 1 << 18  # 1 MiB of float32: a ring, not one exchange


def _count_lanes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every _Lane the transports create, in order."""
    made: list[Any] = []
    init = grpc_streams._Lane.__init__

    def counted(self: Any, call: Any) -> None:
        init(self, call)
        made.append(self)

    monkeypatch.setattr(grpc_streams._Lane, "__init__", counted)
    return made


async def _all_reduce_checked(peers: list[fg.Peer], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    inputs = [torch.randn(N, generator=g) for _ in peers]
    ref = reference_sum(inputs)
    outs = [t.clone() for t in inputs]
    await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, outs, strict=True)))
    for t in outs:
        # (allclose: torch.testing.assert_close takes a second on 1 MiB here)
        assert torch.allclose(t.double(), ref, atol=1e-4, rtol=1e-5)


async def test_ring_collectives_reuse_their_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _count_lanes(monkeypatch)
    async with fg.testing.local_group(3, timeouts=FAST, direct=False) as peers:
        await _all_reduce_checked(peers, 0)
        assert made
        for step in range(1, 40):
            await _all_reduce_checked(peers, step)
        # Forty ring all-reduces, three streams each, and a dozen lanes:
        # each stream went on a lane an earlier one left idle. A stream ends
        # in the background (OutStream.end), so the next collective may
        # start before its lane is idle again, and takes another; at most
        # IDLE_LANES per rank and lane index are kept.
        # (Three (rank, lane index) pairs: each rank's to its right.)
        assert len(made) <= grpc_streams.IDLE_LANES * 3, len(made)
        assert not any(lane.dead for lane in made)
    # Closing waited for every lane's call to end (its reads answered): an
    # operation left pending is delivered after the loop closes, to another
    # loop of the process, which fails with "Event loop is closed".
    assert all(lane.call.done() and lane._reader.done() for lane in made)
    ended = [await lane.call.code() for lane in made]
    # The ranks close one after another: the first one's lanes were idle and
    # their receivers alive, so they ended cleanly, not cancelled.
    assert grpc.StatusCode.OK in ended, ended


async def test_a_refused_stream_takes_only_its_lane_down(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _count_lanes(monkeypatch)
    async with fg.testing.local_group(3, timeouts=FAST, direct=False) as peers:
        await _all_reduce_checked(peers, 0)
        before = len(made)
        # Rank 2 refuses its call (an expanded tensor: its own argument
        # checks raise at once); ranks 0 and 1 stream to their right
        # neighbours, and the refusal fails those streams, whose lanes go.
        calls = [peers[0].all_reduce(torch.ones(N)), peers[1].all_reduce(torch.ones(N))]
        with pytest.raises(fg.ConfigError):
            peers[2].all_reduce(torch.zeros(1, N // 4).expand(4, N // 4))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r, res in enumerate(results):
            assert isinstance(res, fg.ConfigError) and res.peer == 2, (r, res)
        for step in range(1, 4):
            await _all_reduce_checked(peers, step)
        assert all(fg.testing.broken(p) is None for p in peers)
        assert len(made) >= before
        killed = [lane for lane in made if lane.dead]
        assert killed  # the refused streams' lanes
    # The killed lanes too were waited for at close, not forgotten.
    assert all(lane.call.done() and lane._reader.done() for lane in made)


def _identity(b: bytes) -> bytes:
    return b


async def _rogue_lane(
    address: str, streams: list[list[bytes]], metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[grpc.StatusCode, list[bytes]]:
    """Send ``streams`` down one Lane as an outsider, each ended by an empty
    message; return the final status and the answers."""
    answers: list[bytes] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            LANE_METHOD, request_serializer=_identity, response_deserializer=_identity
        )(metadata=metadata, timeout=10)

        async def read() -> None:
            while True:
                answer = await call.read()
                if answer is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return
                answers.append(answer)

        reader = asyncio.ensure_future(read())
        try:
            for stream in streams:
                for message in stream:
                    await call.write(message)
                await call.write(b"")
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the server already ended the call: its status is below
        try:
            await reader
        except grpc.aio.AioRpcError as exc:
            # The server's status (the call's own may be the client's
            # failed write, INTERNAL).
            return exc.code(), answers
        return await call.code(), answers


async def test_an_outsiders_lane_gets_an_answer_per_stream_and_changes_nothing() -> None:
    async with fg.testing.local_group(2, timeouts=FAST, direct=False) as peers:
        await _all_reduce_checked(peers, 0)
        target = peers[1].address
        descriptor = pb.Descriptor(
            kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, numel=100, world_size=2, lanes=1
        )
        header = pb.ChunkHeader(group=0, seq=10**6, kind=pb.ALL_REDUCE, src_rank=0)
        header.descriptor.CopyFrom(descriptor)
        forged = wire.encode(header)  # no session credential
        garbage = [b"\x00" * 7, b"not a chunk at all"]
        status, answers = await _rogue_lane(target, [[forged, b"x" * 64], garbage, []])
        # Three streams, three answers, each the error failing it; the lane
        # ended cleanly.
        assert status == grpc.StatusCode.OK, status
        assert len(answers) == 3, answers
        errors = [pb.Abort.FromString(a) for a in answers]
        assert all(e.error == "ProtocolError" for e in errors), errors
        assert "credential" in errors[0].message, errors[0]
        for step in range(1, 3):
            await _all_reduce_checked(peers, step)
        assert all(fg.testing.broken(p) is None for p in peers)


async def test_a_lane_without_the_token_is_refused() -> None:
    async with fg.testing.local_group(2, token="s3cret-token", timeouts=FAST) as peers:
        await _all_reduce_checked(peers, 0)
        target = peers[1].address
        for metadata in [(), ((TOKEN_METADATA_KEY, "wrong"),)]:
            status, written = await _unheard_lane(target, metadata)
            assert status == grpc.StatusCode.UNAUTHENTICATED, status
            assert not written
        await _all_reduce_checked(peers, 1)


async def _unheard_lane(
    address: str, metadata: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, bool]:
    """Open a Lane, wait for its status before writing (a client's write
    that loses the race with the server's refusal makes grpc.aio mark the
    call INTERNAL on its own side, hiding the server's status), then try a
    stream; return the status and whether the write went through."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            LANE_METHOD, request_serializer=_identity, response_deserializer=_identity
        )(metadata=metadata, timeout=10)
        status = await call.code()
        try:
            await call.write(b"x")
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return status, False
        return status, True


class _SlowReader:
    """A StreamHandler that starts reading each stream late (a busy
    neighbour), and keeps what it read and how the stream ended."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.read: list[bytes] = []
        self.ended: list[str] = []

    async def handle_stream(self, stream: Any, origin: str) -> None:
        self.read.append(await stream.read())  # the opening
        await asyncio.sleep(self.delay)
        while (message := await stream.read()) is not None:
            self.read.append(message)
        self.ended.append("cut" if getattr(stream.rest, "cut", False) else "clean")

    async def handle_abort(self, message: bytes) -> None:
        pass


@pytest.mark.parametrize("delay", [0.0, 0.6])
async def test_a_stream_ended_in_the_background_lands_before_its_transport_closes(
    delay: float,
) -> None:
    # A ring's stream ends in the background (OutStream.end): its sender
    # returns before the receiver has read its last end markers. Settling
    # (what a Peer's close does, for its notice grace) lets a receiver that
    # reads late still get everything and a clean end; the lane is then
    # idle, not killed.
    reader = _SlowReader(delay)
    receiver = grpc_streams.GrpcTransport("127.0.0.1:0")
    sender = grpc_streams.GrpcTransport("127.0.0.1:0")
    address = await receiver.start(reader)
    await sender.start(_SlowReader(0.0))
    sender.connect([address])
    try:
        stream = await sender.open(0, 0)
        messages = [bytes([i]) * (i + 1) for i in range(1, 4)]
        for message in messages:
            await stream.write(message)
        stream.end()
        await sender.settle(5.0)
        assert reader.read == messages and reader.ended == ["clean"]
        assert sender._idle[(0, 0)] and not sender._idle[(0, 0)][0].dead
    finally:
        await sender.close()
        await receiver.close()


async def test_a_replayed_opening_is_read_first_and_then_let_go() -> None:
    # The transport puts a stream's opening back in front of it for the
    # intake; a ring's opening carries its first chunk, which must not stay
    # alive (in the stream the collective holds) once read.
    class Rest:
        def __init__(self) -> None:
            self.left = [b"second", None]

        async def read(self) -> bytes | None:
            return self.left.pop(0)

    opening = bytes(1 << 20)
    stream = Replayed(opening, Rest())
    before = sys.getrefcount(opening)
    assert await stream.read() is opening
    assert sys.getrefcount(opening) == before - 1  # the stream holds it no more
    assert await stream.read() == b"second"
    assert await stream.read() is None


@pytest.mark.parametrize("transport", ["memory", "grpc"])
async def test_no_one_keeps_a_rings_opening_until_its_end(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ring's opening carries its first chunk (up to a whole chunk, 4 MiB
    # by default): neither its sender, nor the transport, nor the receiving
    # intake may keep it for the rest of the collective. Who holds the
    # first opening is looked at when everything has been sent and
    # received, and the end markers are going round.
    openings: list[bytes] = []
    owner: list[lane.LaneRunner] = []
    holders: list[list[str]] = []
    framed = lane.LaneRunner._opening_chunk
    write = lane.LaneRunner._write

    def recorded(self: lane.LaneRunner, opening: Any) -> tuple[bytes, int] | None:
        framing = framed(self, opening)
        if framing is not None and not openings:
            openings.append(framing[0])
            owner.append(self)
        return framing

    async def looked_at(self: lane.LaneRunner, stream: Any, message: bytes, step: int) -> None:
        header, _ = wire.decode(message)
        # (The sender's own frame is seen only while it waits: so when its
        # left neighbour, which it waits for, writes its first end marker.)
        if (
            header.end == 1
            and owner
            and self.right == owner[0].ctx.identity.rank
            and self.job.seq == owner[0].job.seq
            and not holders
        ):
            gc.collect()
            found = [
                getattr(getattr(r, "cr_code", None), "co_qualname", type(r).__name__)
                for r in gc.get_referrers(openings[0])
                if r is not openings
            ]
            holders.append(found)
        await write(self, stream, message, step)

    monkeypatch.setattr(lane.LaneRunner, "_opening_chunk", recorded)
    monkeypatch.setattr(lane.LaneRunner, "_write", looked_at)
    policy = fg.ChunkPolicy(max_lanes=1)
    async with fg.testing.local_group(3, transport=transport, chunk_policy=policy) as peers:  # type: ignore[arg-type]
        tensors = [torch.full((3 << 20,), float(r)) for r in range(3)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)))
        assert all(bool(t.eq(3.0).all()) for t in tensors)
    assert openings and len(openings[0]) > 1 << 20, "no opening carried a chunk"
    assert holders == [[]], f"the opening was still held by {holders}"


async def test_an_opening_whose_write_fails_is_not_counted_as_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The opening carries the ring's first chunk: its bytes count as sent
    # (fg.testing.stats, the metrics) once its write is done, not when it is
    # framed. Rank 0's opening write fails here: it sends nothing else, and
    # nothing may be counted.
    write = lane.LaneRunner._write

    async def failing(self: lane.LaneRunner, stream: Any, message: bytes, step: int) -> None:
        if self.ctx.identity.rank == 0 and wire.decode(message)[0].HasField("descriptor"):
            raise fg.PeerError("the opening's write failed (injected)", rank=0, peer=1)
        await write(self, stream, message, step)

    monkeypatch.setattr(lane.LaneRunner, "_write", failing)
    async with fg.testing.local_group(2, timeouts=FAST, direct=False) as peers:
        before = fg.testing.stats(peers[0]).bytes_sent
        tensors = [torch.ones(N) for _ in peers]
        results = await asyncio.gather(
            *(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)),
            return_exceptions=True,
        )
        assert isinstance(results[0], fg.PeerError), results
        assert "injected" in str(results[0])
        assert fg.testing.stats(peers[0]).bytes_sent == before
        # (The opening did carry a chunk: rank 1's, written, is counted.)
        assert fg.testing.stats(peers[1]).bytes_sent > 0
