"""Hand framing: what wire.encode and wire.Frame write is a valid Chunk, with
an aligned payload, and decodes back to the same header and bytes."""

from __future__ import annotations

import pytest
import torch

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


def test_header_bytes_reads_the_length_only() -> None:
    header = pb.ChunkHeader(seq=7, src_rank=1, nonce="n" * 40)
    header.descriptor.numel = 10
    bare = wire.encode(header)
    framed = wire.encode(header, b"\x01" * 5000)
    size = len(header.SerializeToString())
    assert wire.header_bytes(bare) == size
    assert wire.header_bytes(framed) == size  # the payload is not counted
    # Another layout, or garbage: the whole message counts.
    other = pb.Chunk(header=header, payload=b"\x02" * 10).SerializeToString()[::-1]
    assert wire.header_bytes(other) == len(other)
    assert wire.header_bytes(b"\x0a\xff") == 2  # a truncated length
