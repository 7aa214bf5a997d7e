"""Hand framing of ``ferrogrpc.v1.Chunk`` messages for the bulk path.

A Chunk on the wire is field 1 (the ChunkHeader, length-delimited) followed by
field 2 (the payload, length-delimited). Writing those bytes by hand avoids
building a protobuf object around the payload (upb copies ``bytes`` fields on
set and again on serialize); reading them by hand lets the payload stay a
``memoryview`` into the received buffer. A message that any protobuf encoder
wrote in another valid field order still decodes, through the slow path.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from .errors import ProtocolError
from .v1 import collective_pb2 as pb

_HEADER_TAG = 0x0A  # field 1, wire type 2
_PAYLOAD_TAG = 0x12  # field 2, wire type 2
_PAD_TAG = 0x1A  # field 3, wire type 2
# Payload alignment in the message; a bytes object's data is 16-byte aligned.
_ALIGN = 8


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(buf)
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise ValueError("truncated or overlong varint")


_PADS = [bytes((_PAD_TAG, n)) + bytes(n) for n in range(_ALIGN + 2)]


def encode(header: pb.ChunkHeader, payload: memoryview | bytes = b"") -> bytes:
    """Frame one chunk: header, padding, payload. The payload is copied once,
    into the message, and lands 8-byte aligned."""
    head = header.SerializeToString()
    plen = len(payload) if isinstance(payload, bytes) else payload.nbytes
    prefix = bytes((_HEADER_TAG,)) + _varint(len(head)) + head
    suffix = bytes((_PAYLOAD_TAG,)) + _varint(plen)
    # A pad field costs two bytes plus its length; choose it so that the
    # payload offset is a multiple of _ALIGN.
    unaligned = len(prefix) + 2 + len(suffix)
    pad = _PADS[(-unaligned) % _ALIGN]
    return b"".join((prefix, pad, suffix, payload))


def decode(message: bytes) -> tuple[pb.ChunkHeader, memoryview]:
    """Split a received message into its header and a zero-copy payload view.

    Raises ProtocolError (without rank context; the caller adds it) when the
    bytes are not a Chunk.
    """
    buf = memoryview(message)
    try:
        if len(buf) >= 2 and buf[0] == _HEADER_TAG:
            hlen, pos = _read_varint(buf, 1)
            hend = pos + hlen
            if hend <= len(buf):
                header = pb.ChunkHeader.FromString(buf[pos:hend])  # type: ignore[arg-type]
                if hend + 1 < len(buf) and buf[hend] == _PAD_TAG and buf[hend + 1] < 0x80:
                    hend += 2 + buf[hend + 1]
                if hend == len(buf):
                    return header, buf[hend:]
                if hend < len(buf) and buf[hend] == _PAYLOAD_TAG:
                    plen, ppos = _read_varint(buf, hend + 1)
                    if ppos + plen == len(buf):
                        return header, buf[ppos:]
        # Valid protobuf in another layout (or garbage): the general parser.
        chunk = pb.Chunk.FromString(message)
    except (DecodeError, ValueError) as exc:
        raise ProtocolError(f"undecodable chunk of {len(buf)} bytes: {exc}") from exc
    return chunk.header, memoryview(chunk.payload)
