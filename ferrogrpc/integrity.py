"""Chunk integrity: a CRC of every payload.

On by default (``FERROGRPC_CHECKSUM=0`` or ``checksum=False`` turns it off).
CRC32C comes from the ``crc32c`` package (hardware accelerated); where it is
not installed, zlib's CRC-32 is used instead, which detects the same classes
of error. The algorithm travels in every collective's descriptor, so ranks
that disagree get a ProtocolError instead of spurious checksum failures. A
chunk that fails its check raises ProtocolError naming the sender, and is
never applied to a tensor.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

from .options import CHECKSUM_ENV
from .v1 import collective_pb2 as pb

Checksum = Callable[[memoryview], int]

_crc32c: Any
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - depends on the environment
    _crc32c = None


def crc32c(data: memoryview) -> int:
    """CRC32C (Castagnoli) of ``data``; requires the ``crc32c`` package."""
    if _crc32c is None:
        raise RuntimeError("the crc32c package is not installed")
    return int(_crc32c.crc32c(data))


def crc32(data: memoryview) -> int:
    """zlib's CRC-32 of ``data``."""
    return zlib.crc32(data)


def default_checksum() -> Checksum:
    return crc32c if _crc32c is not None else crc32


def checksum_kind(fn: Checksum | None) -> int:
    if fn is None:
        return pb.CHECKSUM_NONE
    if fn is crc32:
        return pb.CHECKSUM_CRC32
    return pb.CHECKSUM_CRC32C


def resolve_checksum(enabled: bool | None) -> Checksum | None:
    if enabled is None:
        enabled = os.environ.get(CHECKSUM_ENV, "1").lower() not in ("0", "false", "no", "off")
    return default_checksum() if enabled else None
