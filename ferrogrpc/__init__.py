"""ferrogrpc: data-parallel (DDP) and fully sharded (FSDP) PyTorch training over
asyncio gRPC ring collectives.

The public API is exactly what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (
    CollectiveTimeoutError,
    ConfigError,
    FerroGrpcError,
    PeerError,
    ProtocolError,
    RendezvousError,
)
from .options import ChunkPolicy, Timeouts, TLSConfig

__version__ = "0.1.0"


def _torch_free_program() -> bool:
    """Whether this process runs the coordinator (``python -m server``) or
    its healthcheck (``python -m server.health``) from this project: they
    use no torch, and a torch import costs seconds of CPU (every 2 s, as a
    container healthcheck)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    origin = getattr(spec, "origin", None)
    return origin is not None and Path(origin).parent == Path(__file__).parent.parent / "server"


if TYPE_CHECKING or not _torch_free_program():
    # Everything else imports the whole API now, and with it registers the
    # torch.distributed backend (``dist.init_process_group("ferrogrpc")``).
    from . import testing
    from ._api import DDP, FSDP, SUPPORTED_DTYPES, Backend, Peer, ReduceOp, Work, init_backend
else:

    def __getattr__(name: str) -> Any:
        # The torch-free programs still get the rest on first use (a name
        # _api does not have yet, while it imports, is missing for now).
        if name in __all__ or name == "torch_backend":
            api = importlib.import_module("ferrogrpc._api")
            if hasattr(api, name):
                return getattr(api, name)
        raise AttributeError(f"module 'ferrogrpc' has no attribute {name!r}")


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
