"""Hand framing of ``ferrogrpc.v1.Chunk`` messages for the bulk path.

A Chunk on the wire is field 1 (the ChunkHeader, length-delimited) followed by
field 2 (the payload, length-delimited). Writing those bytes by hand avoids
building a protobuf object around the payload (upb copies ``bytes`` fields on
set and again on serialize); reading them by hand lets the payload stay a
``memoryview`` into the received buffer. A message that any protobuf encoder
wrote in another valid field order still decodes, through the slow path.
"""

from __future__ import annotations

import ctypes
import warnings

import torch
from google.protobuf.message import DecodeError

from ..errors import ProtocolError
from ..v1 import collective_pb2 as pb

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


def _around(header: pb.ChunkHeader, plen: int) -> tuple[bytes, bytes]:
    """The header field, and the payload field's tag and length: what goes
    before and after the pad field."""
    head = header.SerializeToString()
    return (
        bytes((_HEADER_TAG,)) + _varint(len(head)) + head,
        bytes((_PAYLOAD_TAG,)) + _varint(plen),
    )


def encode(header: pb.ChunkHeader, payload: memoryview | bytes = b"") -> bytes:
    """Frame one chunk: header, padding, payload. The payload is copied once,
    into the message, and lands 8-byte aligned."""
    plen = len(payload) if isinstance(payload, bytes) else payload.nbytes
    lead, tail = _around(header, plen)
    # A pad field costs two bytes plus its length; choose it so that the
    # payload offset is a multiple of _ALIGN.
    pad = _PADS[(-(len(lead) + 2 + len(tail))) % _ALIGN]
    return b"".join((lead, pad, tail, payload))


# A bytes object whose contents are filled in after it is created: the C
# API's own pattern (PyBytes_FromStringAndSize with a NULL source gives an
# uninitialised object, which its creator writes before anyone else sees it).
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
_new_bytes.restype = ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = [ctypes.py_object]
_bytes_address.restype = ctypes.c_void_p


class Frame:
    """A chunk message built around its payload: the payload is written in
    place first (a reduction's ``out=``), the header afterwards (its CRC is
    only known then). Saves the copy that :func:`encode` makes.

    ``bound`` is a header at least as long as the final one will be (the
    same fields, with any CRC set); the pad field absorbs the difference.
    The message is not shared until :meth:`seal` returns it.
    """

    __slots__ = ("_address", "_message", "_offset", "_size")

    def __init__(self, bound: pb.ChunkHeader, nbytes: int) -> None:
        size = _varint(nbytes)
        head = bound.ByteSize()
        # tag + length + header, a pad field (2 bytes at least), tag + length.
        unpadded = 1 + len(_varint(head)) + head + 2 + 1 + len(size)
        self._offset = unpadded + (-unpadded) % _ALIGN
        self._size = nbytes
        self._message: bytes = _new_bytes(None, self._offset + nbytes)
        self._address: int = _bytes_address(self._message)

    def payload(self, dtype: torch.dtype) -> torch.Tensor:
        """A writable 1-D tensor over the payload. It does not keep the
        message alive: use it only while this Frame is referenced, and not
        after :meth:`seal` (the message is shared from then on)."""
        if self._size == 0:
            return torch.empty(0, dtype=dtype)
        raw = (ctypes.c_char * self._size).from_address(self._address + self._offset)
        return torch.frombuffer(raw, dtype=dtype, count=self._size // dtype.itemsize)

    def view(self) -> memoryview:
        """The payload bytes (for the checksum)."""
        return memoryview(self._message)[self._offset :]

    def seal(self, header: pb.ChunkHeader) -> bytes:
        """Write the header in front of the payload; returns the message."""
        lead, tail = _around(header, self._size)
        pad = self._offset - len(lead) - len(tail) - 2
        if not 0 <= pad < 0x80:
            raise ValueError(f"a header field of {len(lead)} bytes does not fit the frame's bound")
        prefix = b"".join((lead, bytes((_PAD_TAG, pad)), bytes(pad), tail))
        ctypes.memmove(self._address, prefix, len(prefix))
        message, self._message = self._message, b""
        return message


def decode(message: bytes) -> tuple[pb.ChunkHeader, memoryview]:
    """Split a received message into its header and a zero-copy payload view.

    Raises ProtocolError (without rank context; the caller adds it) when the
    bytes are not a Chunk.
    """
    buf = memoryview(message)
    try:
        framed = _framed(buf)
        if framed is not None:
            (pos, hend), start = framed
            header = pb.ChunkHeader.FromString(buf[pos:hend])  # type: ignore[arg-type]
            return header, buf[start:]
        # Valid protobuf in another layout (or garbage): the general parser.
        chunk = pb.Chunk.FromString(message)
    except (DecodeError, ValueError) as exc:
        raise ProtocolError(f"undecodable chunk of {len(buf)} bytes: {exc}") from exc
    return chunk.header, memoryview(chunk.payload)


def decode_opening(message: bytes, max_header: int) -> tuple[pb.ChunkHeader, memoryview]:
    """:func:`decode` for a stream's first message, from a sender not yet
    known: only in this module's own layout (one header field, then the
    payload's), and a header of at most ``max_header`` bytes, its length
    read before anything is parsed. Raises ProtocolError otherwise."""
    buf = memoryview(message)
    try:
        framed = _framed(buf)
        if framed is None:
            raise ProtocolError("not a header followed by its payload")
        (pos, hend), start = framed
        if hend - pos > max_header:
            raise ProtocolError(f"a header of {hend - pos} bytes (at most {max_header})")
        return pb.ChunkHeader.FromString(buf[pos:hend]), buf[start:]  # type: ignore[arg-type]
    except (DecodeError, ValueError) as exc:
        raise ProtocolError(f"an undecodable header: {exc}") from exc


def _framed(buf: memoryview) -> tuple[tuple[int, int], int] | None:
    """Where the header lies, and where the payload starts, in a message of
    the layout :func:`encode` writes (the header field, an optional pad
    field, the payload field or nothing); None for any other layout."""
    if len(buf) < 2 or buf[0] != _HEADER_TAG:
        return None
    hlen, pos = _read_varint(buf, 1)
    hend = end = pos + hlen
    if hend > len(buf):
        return None
    if end + 1 < len(buf) and buf[end] == _PAD_TAG and buf[end + 1] < 0x80:
        end += 2 + buf[end + 1]
    if end == len(buf):
        return (pos, hend), end
    if end < len(buf) and buf[end] == _PAYLOAD_TAG:
        plen, ppos = _read_varint(buf, end + 1)
        if ppos + plen == len(buf):
            return (pos, hend), ppos
    return None


class Scratch:
    """A buffer of one dtype reused from chunk to chunk (a lane's), grown
    when a chunk needs more."""

    __slots__ = ("_buf", "dtype")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._buf: torch.Tensor | None = None

    def empty(self, n: int) -> torch.Tensor:
        """The first ``n`` elements, as they are."""
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=self.dtype)
        return self._buf[:n]

    def filled(self, values: torch.Tensor) -> torch.Tensor:
        """The first ``values.numel()`` elements, holding ``values`` converted."""
        out = self.empty(values.numel())
        out.copy_(values)
        return out


def _silence_readonly_warning() -> None:
    # Received payloads are read-only bytes; torch warns (once per process)
    # that a tensor over them could be written. We only ever read them, so
    # spend the one warning here, silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(b"\0\0\0\0", dtype=torch.uint8)


_silence_readonly_warning()


def bytes_view(data: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous 1-D CPU tensor (valid while the
    tensor lives; it is consumed at once by the encoder's single copy)."""
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")
