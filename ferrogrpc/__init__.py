"""ferrogrpc: data-parallel (DDP) and fully sharded (FSDP) PyTorch training over
asyncio gRPC ring collectives.

The public API is exactly what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

from . import testing, torch_backend
from .backend import Backend
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
from .startup import init_backend
from .work import Work

__version__ = "0.1.0"

# ``dist.init_process_group("ferrogrpc")`` works once ferrogrpc is imported.
torch_backend.register()

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
