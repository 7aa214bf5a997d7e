"""The part of the public API that needs torch, imported by the package
(see ``ferrogrpc/__init__.py``): importing it registers the
torch.distributed backend."""

from __future__ import annotations

from . import testing
from .ops import SUPPORTED_DTYPES, ReduceOp
from .runtime.backend import Backend
from .runtime.peer import Peer
from .runtime.startup import init_backend
from .runtime.work import Work
from .wrappers import process_group as torch_backend
from .wrappers.ddp import DDP
from .wrappers.fsdp import FSDP

# ``dist.init_process_group("ferrogrpc")`` works once ferrogrpc is imported.
torch_backend.register()

__all__ = [
    "DDP",
    "FSDP",
    "SUPPORTED_DTYPES",
    "Backend",
    "Peer",
    "ReduceOp",
    "Work",
    "init_backend",
    "testing",
    "torch_backend",
]
