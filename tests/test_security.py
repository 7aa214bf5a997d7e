"""Integrity and security: corrupted chunks, shared-token authentication,
mutual TLS, a rogue client impersonating a ring neighbour, and fuzzed input."""

from __future__ import annotations

import asyncio
import datetime
import threading
import zlib
from collections.abc import Callable, Iterator

import crc32c as crc32c_package
import grpc
import grpc.aio
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ferrogrpc as fg
from ferrogrpc import wire
from ferrogrpc.testing import Fault, FaultKind
from ferrogrpc.transport import ABORT_METHOD, SEND_METHOD, TOKEN_METADATA_KEY
from ferrogrpc.v1 import collective_pb2 as pb

pytestmark = pytest.mark.timeout(120)
FAST = fg.Timeouts(collective=20, idle=5, connect=10)


def _identity(b: bytes) -> bytes:
    return b


async def _rogue_send(
    address: str, messages: list[bytes], metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    """Send a stream to a peer as an outsider; return the status it gets."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_unary(
            SEND_METHOD, request_serializer=_identity, response_deserializer=_identity
        )(metadata=metadata, timeout=5)
        try:
            for m in messages:
                await call.write(m)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the server already answered: its status is below
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def _chunk(
    seq: int,
    src: int,
    descriptor: pb.Descriptor | None = None,
    payload: bytes = b"",
    nonce: str = "",
) -> bytes:
    header = pb.ChunkHeader(group=0, seq=seq, kind=pb.ALL_REDUCE, src_rank=src, nonce=nonce)
    if descriptor is not None:
        header.descriptor.CopyFrom(descriptor)
    return wire.encode(header, payload)


async def test_corrupted_chunk_is_named_and_reaches_no_tensor(
    report: Callable[[str], None],
) -> None:
    async with fg.testing.local_group(
        3,
        timeouts=FAST,
        chunk_policy=fg.ChunkPolicy(chunk_bytes=256 << 10),
        faults=[Fault(rank=1, kind=FaultKind.CORRUPT_PAYLOAD, nth=2, collective="broadcast")],
    ) as peers:
        tensors = [torch.zeros(1 << 20) for _ in range(3)]
        tensors[0].fill_(1.0)
        results = await asyncio.gather(
            *(p.broadcast(t, root=0) for p, t in zip(peers, tensors, strict=True)),
            return_exceptions=True,
        )
        for r, res in enumerate(results):
            assert isinstance(res, fg.ProtocolError), (r, res)
            assert res.peer == 1, res
        detected = results[2]
        assert "crc32 check" in str(detected) and "rank 1" in str(detected), detected
        # The detecting rank gives its own finding, not another rank's relay of it.
        assert "reported" not in str(detected), detected
        # Rank 2 holds only values that were really sent (1.0) or untouched (0.0).
        assert set(torch.unique(tensors[2]).tolist()) <= {0.0, 1.0}
        report(f"corrupted chunk detected: {detected}")


async def test_checksum_off_is_switchable() -> None:
    async with fg.testing.local_group(2, checksum=False) as peers:
        ts = [torch.ones(1000), torch.ones(1000)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, ts, strict=True)))
        assert ts[0][0].item() == 2.0


def test_checksum_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferrogrpc import integrity

    data = memoryview(bytes(range(256)) * 4099)
    # ISA-L (where installed) and zlib compute the same CRC-32, so ranks with
    # and without ISA-L agree.
    assert integrity.crc32(data) == zlib.crc32(data)
    assert integrity.crc32c(data) == crc32c_package.crc32c(data)
    assert integrity.crc32(data) != integrity.crc32c(data)
    for value, expected in [
        (None, integrity.crc32),
        ("on", integrity.crc32),
        ("crc32", integrity.crc32),
        ("CRC32C", integrity.crc32c),
        ("0", None),
        ("off", None),
    ]:
        if value is None:
            monkeypatch.delenv("FERROGRPC_CHECKSUM", raising=False)
        else:
            monkeypatch.setenv("FERROGRPC_CHECKSUM", value)
        assert integrity.resolve_checksum(None) is expected, value
    monkeypatch.setenv("FERROGRPC_CHECKSUM", "md5")
    with pytest.raises(fg.ConfigError, match="FERROGRPC_CHECKSUM='md5'"):
        integrity.resolve_checksum(None)
    assert integrity.resolve_checksum("crc32c") is integrity.crc32c
    assert integrity.resolve_checksum(False) is None
    with pytest.raises(fg.ConfigError, match="checksum='sha1'"):
        integrity.resolve_checksum("sha1")


async def test_crc32c_by_name_runs_collectives() -> None:
    async with fg.testing.local_group(3, checksum="crc32c") as peers:
        assert all(p.checksum is not None and p.checksum.__name__ == "crc32c" for p in peers)
        ts = [torch.full((3000,), float(r)) for r in range(3)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, ts, strict=True)))
        assert all(t.eq(3.0).all() for t in ts)


async def test_token_refuses_clients_without_it() -> None:
    async with fg.testing.local_group(2, token="s3cret-token", timeouts=FAST) as peers:
        ts = [torch.ones(100), torch.ones(100)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, ts, strict=True)))
        assert ts[1][0].item() == 2.0
        target = peers[1].address
        descriptor = pb.Descriptor(
            kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, numel=100, world_size=2, lanes=1
        )
        forged = [_chunk(peers[1]._seq + 1, 0, descriptor)]
        assert await _rogue_send(target, forged) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await _rogue_send(target, forged, ((TOKEN_METADATA_KEY, "wrong"),))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        async with grpc.aio.insecure_channel(target) as channel:
            abort = channel.unary_unary(
                ABORT_METHOD, request_serializer=_identity, response_deserializer=_identity
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await abort(pb.Abort(from_rank=0, message="forged").SerializeToString(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Nothing reached a tensor, and the group still works.
        ts = [torch.full((100,), 3.0), torch.full((100,), 4.0)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, ts, strict=True)))
        assert ts[0].eq(7.0).all() and ts[1].eq(7.0).all()


async def test_rogue_neighbour_during_a_collective_changes_nothing() -> None:
    async with fg.testing.local_group(3, timeouts=FAST) as peers:
        n = 1 << 16
        inputs = [torch.full((n,), float(r + 1)) for r in range(3)]
        seq = peers[1]._seq + 1
        descriptor = pb.Descriptor(
            kind=pb.ALL_REDUCE,
            dtype=pb.FLOAT32,
            numel=n,
            reduce_op=pb.SUM,
            world_size=3,
            lanes=1,
            chunk_elems=fg.ChunkPolicy().resolve(3)[0] // 4,
        )
        garbage = torch.full((n // 3 + 1,), 1e6).numpy().tobytes()
        # Ranks 1 and 2 start; rank 0 (rank 1's left neighbour) is late, and a
        # rogue claims to be rank 0 first, with and without a guessed nonce.
        work = [asyncio.ensure_future(peers[r].all_reduce(inputs[r])) for r in (1, 2)]
        await asyncio.sleep(0.05)
        for nonce in ("", "0" * 32):
            status = await _rogue_send(
                peers[1].address,
                [_chunk(seq, 0, descriptor, nonce=nonce), _chunk(seq, 0, payload=garbage)],
            )
            assert status == grpc.StatusCode.INVALID_ARGUMENT, status
        await peers[0].all_reduce(inputs[0])
        await asyncio.gather(*work)
        for t in inputs:
            assert t.eq(6.0).all()


def _certificates(tmp: str) -> tuple[fg.TLSConfig, fg.TLSConfig]:
    """A CA, a peer certificate signed by it, and a stranger's certificate."""

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    now = datetime.datetime.now(datetime.UTC)

    def cert(
        subject: str,
        k: ec.EllipticCurvePrivateKey,
        issuer: str,
        issuer_key: ec.EllipticCurvePrivateKey,
        ca: bool,
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("ferrogrpc-peer")]), critical=False
            )
        return builder.sign(issuer_key, hashes.SHA256())

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key, other_ca_key, peer_key, stranger_key = key(), key(), key(), key()
    ca = cert("ferrogrpc test CA", ca_key, "ferrogrpc test CA", ca_key, True)
    other_ca = cert("someone else", other_ca_key, "someone else", other_ca_key, True)
    peer = cert("ferrogrpc-peer", peer_key, "ferrogrpc test CA", ca_key, False)
    stranger = cert("ferrogrpc-peer", stranger_key, "someone else", other_ca_key, False)
    pem = serialization.Encoding.PEM
    good = fg.TLSConfig(
        peer.public_bytes(pem), pem_key(peer_key), ca.public_bytes(pem), "ferrogrpc-peer"
    )
    bad = fg.TLSConfig(
        stranger.public_bytes(pem),
        pem_key(stranger_key),
        ca.public_bytes(pem) + other_ca.public_bytes(pem),
        "ferrogrpc-peer",
    )
    return good, bad


async def test_mutual_tls(tmp_path: object) -> None:
    good, stranger = _certificates(str(tmp_path))
    async with fg.testing.local_group(2, tls=good, timeouts=FAST) as peers:
        ts = [torch.ones(1000), torch.full((1000,), 2.0)]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, ts, strict=True)))
        assert ts[0].eq(3.0).all()
        target = peers[1].address
        # Plaintext, and TLS with a certificate from another CA: both refused.
        assert await _rogue_send(target, [b"x"]) == grpc.StatusCode.UNAVAILABLE
        creds = grpc.ssl_channel_credentials(
            stranger.root_certificates, stranger.private_key, stranger.certificate_chain
        )
        async with grpc.aio.secure_channel(
            target, creds, options=[("grpc.ssl_target_name_override", "ferrogrpc-peer")]
        ) as channel:
            call = channel.stream_unary(
                SEND_METHOD, request_serializer=_identity, response_deserializer=_identity
            )(timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.write(b"x")
                await call.done_writing()
                await call
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ----------------------------------------------------------------- fuzzing


class _LiveGroup:
    """A 2-rank group on a private loop thread, for synchronous hypothesis tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._cm = fg.testing.local_group(2, timeouts=FAST)
        self.peers = self.run(self._cm.__aenter__())

    def run(self, coro: object, timeout: float = 30) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def check_still_serves(self) -> None:
        async def go() -> None:
            ts = [torch.arange(10.0), torch.arange(10.0)]
            await asyncio.gather(*(p.all_reduce(t) for p, t in zip(self.peers, ts, strict=True)))  # type: ignore[attr-defined]
            assert torch.equal(ts[0], torch.arange(10.0) * 2)

        self.run(go())

    def close(self) -> None:
        self.run(self._cm.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def live_group() -> Iterator[_LiveGroup]:
    group = _LiveGroup()
    yield group
    group.close()


# What the peer may answer to hostile input. UNKNOWN would mean an exception
# escaped a handler, DEADLINE_EXCEEDED a hang. INTERNAL is the *client's*
# own write failing because the peer already refused the stream.
CLEAN = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
}

headers = st.builds(
    pb.ChunkHeader,
    group=st.integers(0, 2**32 - 1),
    seq=st.integers(0, 2**64 - 1),
    kind=st.sampled_from([0, 1, 2, 3, 4, 5, 99]),
    step=st.integers(0, 2**32 - 1),
    src_rank=st.integers(0, 2**32 - 1),
    chunk_index=st.integers(0, 2**32 - 1),
    lane=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    nonce=st.text(max_size=40),
    descriptor=st.builds(
        pb.Descriptor, numel=st.integers(0, 2**64 - 1), world_size=st.integers(0, 9)
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_fuzz_random_bytes(live_group: _LiveGroup, messages: list[bytes]) -> None:
    target = live_group.peers[1].address  # type: ignore[attr-defined]
    status = live_group.run(_rogue_send(target, messages))
    assert status in CLEAN, status


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(header=headers, payload=st.binary(max_size=64), extra=st.lists(headers, max_size=2))
def test_fuzz_malformed_headers(
    live_group: _LiveGroup, header: pb.ChunkHeader, payload: bytes, extra: list[pb.ChunkHeader]
) -> None:
    target = live_group.peers[1].address  # type: ignore[attr-defined]
    messages = [wire.encode(header, payload)] + [wire.encode(h, payload) for h in extra]
    status = live_group.run(_rogue_send(target, messages))
    assert status in CLEAN, status


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=200))
def test_fuzz_abort_rpc(live_group: _LiveGroup, data: bytes) -> None:
    target = live_group.peers[1].address  # type: ignore[attr-defined]

    async def go() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(target) as channel:
            abort = channel.unary_unary(
                ABORT_METHOD, request_serializer=_identity, response_deserializer=_identity
            )
            try:
                await abort(data, timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert live_group.run(go()) in CLEAN


def test_fuzzed_peer_still_serves_correct_collectives(live_group: _LiveGroup) -> None:
    live_group.check_still_serves()
    assert live_group.peers[1].broken is None  # type: ignore[attr-defined]
