"""What an unauthenticated network client can and cannot do to a running
job: one test per claim of SECURITY.md. The job runs as
real rank processes (tests/ranks/serve.py); the client is this test."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable

import grpc
import grpc.aio
import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms.mailboxes import Mailboxes
from ferrogrpc.control.rendezvous import LocalRendezvous, RendezvousResult, StoreRendezvous
from ferrogrpc.env import Settings
from ferrogrpc.errors import Identity
from ferrogrpc.runtime.intake import Intake, credential
from ferrogrpc.runtime.join import message_limit
from ferrogrpc.samehost.plane import _FRAME, HELLO, LocalPlane, _socket_name
from ferrogrpc.transport import wire
from ferrogrpc.transport.auth import token_metadata
from ferrogrpc.transport.grpc_streams import (
    ABORT_METHOD,
    DEFAULT_MAX_MESSAGE,
    HEADER_ROOM,
    SEND_METHOD,
    GrpcTransport,
)
from ferrogrpc.transport.streams import Replayed
from ferrogrpc.v1 import collective_pb2 as pb
from tests.helpers import ServedJob, free_port, memory_of, outsider_send, reset_peak

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _identity(b: bytes) -> bytes:
    return b


def _check_results(answers: list[str]) -> None:
    for rank, answer in enumerate(answers):
        word, error = answer.split()
        assert word == "OK" and float(error) < 1e-9, (rank, answer)


async def _flood(
    address: str, clients: int, nbytes: int, holding: Callable[[], None]
) -> list[grpc.StatusCode | None]:
    """``clients`` connections each send one ``nbytes`` Send message; once
    the peer has answered every one, ``holding()`` runs while the
    connections are still open. Returns the statuses."""
    message = b"\x0a\x00" + bytes(nbytes - 2)  # an empty header, then zeros
    channels = [
        grpc.aio.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", -1), ("grpc.use_local_subchannel_pool", 1)],
        )
        for _ in range(clients)
    ]
    try:
        calls = [
            ch.stream_unary(
                SEND_METHOD, request_serializer=_identity, response_deserializer=_identity
            )(timeout=30)
            for ch in channels
        ]

        async def one(call: grpc.aio.StreamUnaryCall[bytes, bytes]) -> grpc.StatusCode | None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(message)  # fails if already answered
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        statuses = list(await asyncio.gather(*(one(c) for c in calls)))
        holding()
        return statuses
    finally:
        await asyncio.gather(*(ch.close(None) for ch in channels))


@pytest.mark.timeout(120)
def test_oversized_sends_from_anyone_cost_a_peer_little_memory(
    report: Callable[[str], None],
) -> None:
    # Issue 17, item 1: 16 clients each sending one 40 MiB message and
    # holding on grew a rank by ~700 MiB, for good. A peer now refuses a
    # message longer than one chunk plus its header from its length prefix.
    with ServedJob(2) as job:
        _check_results(job.command("all_reduce"))  # warm: buffers, channels
        pid = job.pids[1]
        before, _ = memory_of(pid)
        reset_peak(pid)
        held: list[tuple[int, int]] = []
        statuses = asyncio.run(
            _flood(job.addresses[1], 16, 40 * MiB, lambda: held.append(memory_of(pid)))
        )
        during, peak = held[0]
        assert all(s is not None and s != grpc.StatusCode.OK for s in statuses), statuses
        growth = max(peak, during) - before
        report(
            f"16 x 40 MiB unauthenticated Send messages: peer RSS {before / MiB:.0f} MiB -> "
            f"{during / MiB:.0f} MiB while the senders hold on, peak {peak / MiB:.0f} MiB "
            f"(+{growth / MiB:.1f} MiB; bar 64); statuses "
            f"{sorted({s.name for s in statuses if s is not None})}"
        )
        assert growth <= 64 * MiB, growth
        _check_results(job.command("all_reduce"))


# ------------------------------------------------------ what listens, where


def _listening(pids: list[int]) -> list[str]:
    """``ss`` lines of the TCP and Unix sockets these processes listen on."""
    out = []
    for flags in ("-ltnpH", "-lxpH"):
        lines = subprocess.run(["ss", flags], capture_output=True, text=True, check=True)
        out += [
            line for line in lines.stdout.splitlines() if any(f"pid={p}," in line for p in pids)
        ]
    return out


def _local_address(line: str) -> str:
    return line.split()[3]


@pytest.mark.timeout(90)
def test_a_single_machine_job_listens_only_on_loopback() -> None:
    # Before: rank 0's TCPStore listened on every interface for the whole job.
    with ServedJob(2) as job:
        lines = _listening(job.pids)
        tcp = [line for line in lines if line.startswith("LISTEN") and ":" in _local_address(line)]
        addresses = sorted(_local_address(line) for line in tcp)
        # The two peers' gRPC servers, on loopback; the store is gone, and the
        # same-host sockets stopped accepting once the ranks connected.
        assert sorted(a.rsplit(":", 1)[1] for a in addresses) == sorted(
            a.rsplit(":", 1)[1] for a in job.addresses
        ), lines
        for address in addresses:
            host = address.rsplit(":", 1)[0]
            assert host in ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]"), lines
        assert not any(f":{job.port} " in line for line in lines), lines
        assert not any("ferrogrpc" in line for line in lines if line.startswith("u_")), lines
        _check_results(job.command("all_reduce"))


def test_the_store_listens_only_on_the_master_address_until_every_rank_read_it() -> None:
    port = free_port()
    master = "127.0.0.2"  # an address of its own, to tell it from 127.0.0.1 and *
    results: dict[int, RendezvousResult] = {}

    def join(rank: int) -> None:
        rdv = StoreRendezvous(rank, 2, master, port, timeout=20)
        results[rank] = asyncio.run(rdv.exchange(rank, 2, f"r{rank}:1", f"nonce-{rank}"))

    host = threading.Thread(target=join, args=(0,))
    host.start()
    deadline = time.monotonic() + 20
    while not (listening := [ln for ln in _listening([os.getpid()]) if f":{port} " in ln]):
        assert time.monotonic() < deadline, "the store never listened"
        time.sleep(0.01)
    assert [_local_address(ln) for ln in listening] == [f"{master}:{port}"], listening
    join(1)
    host.join(20)
    assert results[0].nonces == results[1].nonces == ["nonce-0", "nonce-1"]
    # Rank 0's exchange returned once every rank had read the table, and the
    # store stopped listening.
    assert not [ln for ln in _listening([os.getpid()]) if f":{port} " in ln]


def test_torchs_own_store_listens_on_every_interface() -> None:
    # Why rank 0 hands TCPStore a socket bound to MASTER_ADDR: torch's own
    # binds every interface, whatever host it is given (so does torchrun's).
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    try:
        listening = [ln for ln in _listening([os.getpid()]) if f":{store.port} " in ln]
        assert [_local_address(ln) for ln in listening] == [f"*:{store.port}"], listening
    finally:
        del store


# ------------------------------------------------ credentials and the token


async def _abort(address: str, abort: pb.Abort, token: str | None = None) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(
            ABORT_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            await call(abort.SerializeToString(), timeout=5, metadata=token_metadata(token))
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


async def _start_pair(token: str | None) -> tuple[list[fg.Peer], list[str]]:
    """Two peers on gRPC; returns them and the nonces their store held."""
    rendezvous = LocalRendezvous(2)
    settings = Settings(token=token, shm=False, timeouts=fg.Timeouts(20, 10, 20))
    peers = await asyncio.gather(
        *(
            fg.Peer.start(
                rank,
                2,
                rendezvous=rendezvous,
                transport=GrpcTransport("127.0.0.1:0", token=token),
                settings=settings,
            )
            for rank in range(2)
        )
    )
    nonces = [rendezvous._table[r][1] for r in range(2)]  # what a store reader sees
    return list(peers), nonces


async def _still_correct(peers: list[fg.Peer]) -> None:
    inputs = [torch.randn(70_000, dtype=torch.float64) for _ in peers]
    ref = torch.stack(inputs).sum(0)
    outs = [t.clone() for t in inputs]
    await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, outs, strict=True)))
    for t in outs:
        torch.testing.assert_close(t, ref, atol=1e-10, rtol=1e-10)


async def test_without_a_token_a_nonce_is_the_credential() -> None:
    peers, nonces = await _start_pair(None)
    try:
        target = peers[1].address
        descriptor = pb.Descriptor(kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, numel=4, world_size=2)
        # A guess is refused, for streams and aborts alike; the group is intact.
        opening = pb.ChunkHeader(src_rank=0, seq=99, nonce="0" * 32)
        opening.descriptor.CopyFrom(descriptor)
        status = await outsider_send(target, [wire.encode(opening)], timeout=10)
        assert status == grpc.StatusCode.INVALID_ARGUMENT, status
        guess = pb.Abort(from_rank=0, message="forged", nonce="0" * 32)
        assert await _abort(target, guess) == grpc.StatusCode.INVALID_ARGUMENT
        await _still_correct(peers)
        # The nonce from the store is enough: a forged abort breaks the group.
        forged = pb.Abort(from_rank=0, message="forged by a store reader", nonce=nonces[0])
        assert await _abort(target, forged) == grpc.StatusCode.OK
        broken = fg.testing.broken(peers[1])
        assert broken is not None and "forged by a store reader" in str(broken), broken
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def test_with_a_token_what_the_store_holds_forges_nothing() -> None:
    token = "exposure-token"
    peers, nonces = await _start_pair(token)
    try:
        target = peers[1].address
        forged = pb.Abort(from_rank=0, message="forged", nonce=nonces[0])
        # Without the token: refused before any handler, whatever the method.
        assert await _abort(target, forged) == grpc.StatusCode.UNAUTHENTICATED
        async with grpc.aio.insecure_channel(target) as channel:
            unknown = channel.unary_unary("/no.Such/Method")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unknown(b"", timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Even with the token, the store's nonce is not a rank's credential.
        assert await _abort(target, forged, token) == grpc.StatusCode.INVALID_ARGUMENT
        opening = pb.ChunkHeader(src_rank=0, seq=99, nonce=nonces[0])
        opening.descriptor.CopyFrom(pb.Descriptor(kind=pb.ALL_REDUCE, numel=4, world_size=2))
        status = await outsider_send(target, [wire.encode(opening)], token_metadata(token), 10)
        assert status == grpc.StatusCode.INVALID_ARGUMENT, status
        assert fg.testing.broken(peers[1]) is None
        await _still_correct(peers)
    finally:
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.parametrize("token", [None, "exposure-token"], ids=["no token", "token"])
async def test_with_a_token_the_same_host_hello_needs_more_than_the_nonce(
    token: str | None,
) -> None:
    # The hello on a rank's same-host socket hands out its shared memory.
    nonces = [secrets.token_hex(16) for _ in range(2)]
    proofs = [credential(token, n) for n in nonces]
    planes = [LocalPlane(n) for n in nonces]

    def report(abort: pb.Abort) -> fg.FerroGrpcError:
        return fg.PeerError(abort.message)

    try:
        # Rank 1 waits for rank 0 to connect; a store reader gets there first.
        accepting = asyncio.ensure_future(
            planes[1].connect(
                Identity(1, 2), [0, 1], nonces, 20, report, proofs=proofs, proof=proofs[1]
            )
        )

        def rogue() -> tuple[bytes, int]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(_socket_name(nonces[1]))
                payload = struct.pack("<I", 0) + nonces[0].encode()
                fd = os.memfd_create("rogue")
                os.ftruncate(fd, planes[1].slots * planes[1].slot_bytes)
                # A segment and one end of a direct socket pair, as rank 0's hello has.
                mine, theirs = socket.socketpair()
                try:
                    frame = _FRAME.pack(len(payload), HELLO, 0) + payload
                    socket.send_fds(sock, [frame], [fd, theirs.fileno()])
                finally:
                    os.close(fd)
                    mine.close()
                    theirs.close()
                data, fds, _, _ = socket.recv_fds(sock, 1024, 1)
                for got in fds:
                    os.close(got)
                return data, len(fds)

        data, fds = await asyncio.get_running_loop().run_in_executor(None, rogue)
        if token is None:
            # Without a token the store's nonce is the proof: the rogue is
            # taken for rank 0 and handed rank 1's segment.
            assert data and fds == 1, (data, fds)
            await asyncio.wait_for(accepting, 20)
            return
        assert (data, fds) == (b"", 0)  # hung up on, with nothing handed over
        await planes[0].connect(
            Identity(0, 2), [0, 1], nonces, 20, report, proofs=proofs, proof=proofs[0]
        )
        await asyncio.wait_for(accepting, 20)
        assert set(planes[0].links) == {1} and set(planes[1].links) == {0}
    finally:
        for plane in planes:
            await plane.close()


async def test_the_receive_limit_follows_the_chunk_policy() -> None:
    policy = fg.ChunkPolicy(chunk_bytes=1 << 20)
    limit = message_limit(policy)
    assert limit == (1 << 20) + HEADER_ROOM
    assert message_limit(fg.ChunkPolicy()) == (4 << 20) + HEADER_ROOM == DEFAULT_MAX_MESSAGE
    assert message_limit(fg.ChunkPolicy(chunk_bytes=64)) == (256 << 10) + HEADER_ROOM
    async with fg.testing.local_group(2, chunk_policy=policy) as peers:
        target = peers[1].address
        over = b"\x0a\x00" + bytes(limit - 1)
        assert await outsider_send(target, [over], timeout=10) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Within the limit, a stream must still open with a descriptor, in a
        # header of at most 4 KiB, and the sender's credential: else it is
        # refused before its payload is looked at.
        opening = pb.ChunkHeader(src_rank=0, seq=99)
        opening.descriptor.CopyFrom(pb.Descriptor(kind=pb.ALL_REDUCE, numel=4, world_size=2))
        long = pb.ChunkHeader()
        long.CopyFrom(opening)
        long.nonce = "x" * 5000
        no_descriptor = pb.ChunkHeader(src_rank=0, seq=99)
        # A short header field and then a long one (protobuf merges them).
        small, big = (h.SerializeToString() for h in (pb.ChunkHeader(src_rank=0), long))
        merged = b"\x0a" + wire._varint(len(small)) + small + b"\x0a" + wire._varint(len(big)) + big
        for first in (
            wire.encode(opening, bytes(5000)),
            wire.encode(opening, b"data"),
            wire.encode(long),
            wire.encode(no_descriptor, b"data"),
            merged,
        ):
            status = await outsider_send(target, [first, first], timeout=10)
            assert status == grpc.StatusCode.INVALID_ARGUMENT
        await _still_correct(peers)


async def test_before_the_rendezvous_an_opening_is_held_only_if_small() -> None:
    # Its credential cannot be checked yet: held, an opening is as small as
    # a bare descriptor; a big first chunk is refused at once, as is a link
    # hello with any payload.
    class Rest:
        async def read(self) -> bytes | None:
            return None

    intake = Intake(Mailboxes())  # no rendezvous yet
    opening = pb.ChunkHeader(src_rank=0, seq=1, nonce="n" * 32)
    opening.descriptor.CopyFrom(pb.Descriptor(kind=pb.ALL_REDUCE, numel=2048, world_size=2))
    with pytest.raises(fg.ProtocolError, match="before this rank's rendezvous"):
        await intake.handle_stream(Replayed(wire.encode(opening, bytes(8192)), Rest()), "x")
    # A link's hello never carries data (only a ring's opening does).
    hello = pb.ChunkHeader(src_rank=0, nonce="n" * 32)
    hello.descriptor.kind = pb.LINK
    with pytest.raises(fg.ProtocolError, match="opens with a payload"):
        await intake.handle_stream(Replayed(wire.encode(hello, b"x"), Rest()), "x")
    held = asyncio.ensure_future(
        intake.handle_stream(Replayed(wire.encode(opening, bytes(64)), Rest()), "x")
    )
    await asyncio.sleep(0.2)
    assert not held.done()
    held.cancel()


def test_where_the_store_binds_follows_what_master_addr_names() -> None:
    from ferrogrpc.control.rendezvous import _store_socket

    # An address of this machine, literal or "localhost": that address only.
    for name, bound in (("127.0.0.3", "127.0.0.3"), ("localhost", None)):
        sock = _store_socket(name, 0)
        assert sock is not None
        try:
            host = sock.getsockname()[0]
            assert host == bound if bound else ipaddress.ip_address(host).is_loopback, host
        finally:
            sock.close()
    # Not an address of this machine (behind NAT): every interface, as torch.
    assert _store_socket("192.0.2.254", 0) is None or _is_local("192.0.2.254")
    # A taken port is an error, not a silent second listener.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError):
            _store_socket("127.0.0.1", taken.getsockname()[1])


def _is_local(address: str) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True
