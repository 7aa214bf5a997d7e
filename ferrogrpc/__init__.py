"""ferrogrpc: data-parallel (DDP) and fully sharded (FSDP) PyTorch training over
asyncio gRPC ring collectives.

The public API is exactly what ``__all__`` lists; everything else is private.
Importing the package imports no torch: the names that need it load on
first use, and ``"ferrogrpc"`` is registered with torch.distributed as soon
as torch is loaded (see [Note: import without torch] in
wrappers/registration.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CollectiveTimeoutError,
    ConfigError,
    FerroGrpcError,
    PeerError,
    ProtocolError,
    QuorumLostError,
    RendezvousError,
    ShardLostError,
)
from .options import ChunkPolicy, Timeouts, TLSConfig
from .transport.grpc_tuning import tune_when_grpc_loads
from .wrappers.registration import register_when_torch_loads

if TYPE_CHECKING:
    from . import testing
    from .elastic.backend import ElasticBackend
    from .elastic.epoch import Membership
    from .elastic.state import ElasticState
    from .ops import SUPPORTED_DTYPES, ReduceOp
    from .runtime.backend import Backend
    from .runtime.peer import Peer
    from .runtime.work import Work
    from .startup import init_backend
    from .wrappers.ddp import DDP
    from .wrappers.diloco import DiLoCo
    from .wrappers.fsdp import FSDP

__version__ = "0.1.0"
"""The package's version."""

# The names that need torch, and the module each comes from.
_ON_FIRST_USE = {
    "Backend": "ferrogrpc.runtime.backend",
    "DDP": "ferrogrpc.wrappers.ddp",
    "DiLoCo": "ferrogrpc.wrappers.diloco",
    "ElasticBackend": "ferrogrpc.elastic.backend",
    "ElasticState": "ferrogrpc.elastic.state",
    "Membership": "ferrogrpc.elastic.epoch",
    "FSDP": "ferrogrpc.wrappers.fsdp",
    "Peer": "ferrogrpc.runtime.peer",
    "ReduceOp": "ferrogrpc.ops",
    "SUPPORTED_DTYPES": "ferrogrpc.ops",
    "Work": "ferrogrpc.runtime.work",
    "init_backend": "ferrogrpc.startup",
    "testing": "ferrogrpc.testing",
}


def __getattr__(name: str) -> Any:
    source = _ON_FIRST_USE.get(name)
    if source is None:
        raise AttributeError(f"module 'ferrogrpc' has no attribute {name!r}")
    # torch first, whole: its loading registers the backend, before any
    # module of ours is half imported.
    importlib.import_module("torch")
    module = importlib.import_module(source)
    value = module if name == "testing" else getattr(module, name)
    globals()[name] = value
    return value


tune_when_grpc_loads()
register_when_torch_loads()

__all__ = [
    "SUPPORTED_DTYPES",
    "Backend",
    "ChunkPolicy",
    "CollectiveTimeoutError",
    "ConfigError",
    "DDP",
    "DiLoCo",
    "ElasticBackend",
    "ElasticState",
    "FSDP",
    "FerroGrpcError",
    "Membership",
    "Peer",
    "PeerError",
    "ProtocolError",
    "QuorumLostError",
    "ShardLostError",
    "ReduceOp",
    "RendezvousError",
    "TLSConfig",
    "Timeouts",
    "Work",
    "__version__",
    "init_backend",
    "testing",
]
