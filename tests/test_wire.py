"""Hand framing: what wire.encode and wire.Frame write is a valid Chunk, with
an aligned payload, and decodes back to the same header and bytes."""

from __future__ import annotations

import pytest
import torch

from ferrogrpc.errors import ProtocolError
from ferrogrpc.transport import wire
from ferrogrpc.v1 import collective_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def _header(**kw: int) -> pb.ChunkHeader:
    fields = dict(group=3, seq=2**40 + 7, kind=pb.ALL_REDUCE, step=5, src_rank=9, chunk_index=2)
    fields.update(lane=1, offset=2**33 + 1)
    fields.update(kw)
    return pb.ChunkHeader(**fields)  # type: ignore[arg-type]


def _check(message: bytes, header: pb.ChunkHeader, payload: bytes) -> None:
    got_header, got_payload = wire.decode(message)
    assert got_header == header
    assert bytes(got_payload) == payload
    # Any protobuf parser reads the same message.
    parsed = pb.Chunk.FromString(message)
    assert parsed.header == header and parsed.payload == payload
    assert (len(message) - len(payload)) % 8 == 0  # payload offset is 8-aligned


@pytest.mark.parametrize("nbytes", [0, 4, 1000, 1 << 20])
@pytest.mark.parametrize("crc", [None, 0, 1, 0xFFFFFFFF])
def test_frame_payload_written_in_place_then_sealed(nbytes: int, crc: int | None) -> None:
    bound = _header(has_checksum=True, checksum=0xFFFFFFFF)
    frame = wire.Frame(bound, nbytes)
    values = torch.arange(nbytes // 4, dtype=torch.float32) * 1.5 - 7
    if nbytes:
        torch.add(values, 0.0, out=frame.payload(torch.float32))
    assert bytes(frame.view()) == values.numpy().tobytes()
    final = _header() if crc is None else _header(has_checksum=True, checksum=crc)
    message = frame.seal(final)
    _check(message, final, values.numpy().tobytes())


def test_frame_refuses_a_header_longer_than_its_bound() -> None:
    frame = wire.Frame(_header(seq=1), 8)
    with pytest.raises(ValueError, match="bound"):
        frame.seal(_header(seq=2**63, offset=2**62, step=2**31))


@pytest.mark.parametrize("nbytes", [0, 3, 4096])
def test_encode_round_trips(nbytes: int) -> None:
    payload = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    header = _header(has_checksum=True, checksum=12345)
    _check(wire.encode(header, payload), header, payload)


def test_an_opening_is_decoded_only_in_the_framed_layout() -> None:
    header = pb.ChunkHeader(seq=7, src_rank=1, nonce="n" * 40)
    header.descriptor.numel = 10
    for payload in (b"", b"\x01" * 5000):
        got, view = wire.decode_opening(wire.encode(header, payload), 4096)
        assert got == header and bytes(view) == payload
    # A header over the bound is refused from its length, unparsed.
    long = pb.ChunkHeader()
    long.CopyFrom(header)
    long.nonce = "x" * 5000
    with pytest.raises(ProtocolError, match="header of 50"):
        wire.decode_opening(wire.encode(long), 4096)
    # Any other layout is refused, though decode() reads it: a tiny first
    # header field and a long second one (protobuf merges them), or the
    # payload first.
    small = pb.ChunkHeader(src_rank=0).SerializeToString()
    big = long.SerializeToString()
    two = b"\x0a" + wire._varint(len(small)) + small + b"\x0a" + wire._varint(len(big)) + big
    assert wire.decode(two)[0].nonce == long.nonce
    reordered = pb.Chunk(header=header, payload=b"\x02" * 10).SerializeToString()
    reordered = reordered[-12:] + reordered[:-12]  # the payload field first
    assert wire.decode(reordered)[0] == header
    for message in (two, reordered, b"\x0a\xff", b"garbage"):
        with pytest.raises(ProtocolError):
            wire.decode_opening(message, 4096)
