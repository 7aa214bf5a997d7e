"""ferrogrpc: data-parallel (DDP) and fully sharded (FSDP) PyTorch training over
asyncio gRPC ring collectives.

The public API is exactly what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

from . import testing
from .backend import Backend, Work, init_backend
from .ddp import DDP
from .errors import (
    CollectiveTimeoutError,
    ConfigError,
    FerroGrpcError,
    PeerError,
    ProtocolError,
    RendezvousError,
)
from .fsdp import FSDP
from .ops import SUPPORTED_DTYPES, ReduceOp
from .options import ChunkPolicy, Timeouts, TLSConfig
from .peer import Peer

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "Backend",
    "ChunkPolicy",
    "CollectiveTimeoutError",
    "ConfigError",
    "DDP",
    "FSDP",
    "FerroGrpcError",
    "Peer",
    "PeerError",
    "ProtocolError",
    "ReduceOp",
    "RendezvousError",
    "TLSConfig",
    "Timeouts",
    "Work",
    "__version__",
    "init_backend",
    "testing",
]
