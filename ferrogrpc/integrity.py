"""Chunk integrity: CRC32C of every payload, computed in hardware.

On by default (``FERROGRPC_CHECKSUM=0`` or ``checksum=False`` turns it off; all
ranks must agree). A chunk that fails its check raises ProtocolError naming
the sender, and is never applied to a tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import crc32c as _crc32c

from .options import CHECKSUM_ENV


def crc32c(data: memoryview) -> int:
    """CRC32C (Castagnoli) of ``data``."""
    return int(_crc32c.crc32c(data))


def resolve_checksum(enabled: bool | None) -> Callable[[memoryview], int] | None:
    if enabled is None:
        enabled = os.environ.get(CHECKSUM_ENV, "1").lower() not in ("0", "false", "no", "off")
    return crc32c if enabled else None
