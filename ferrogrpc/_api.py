"""The part of the public API that needs torch, imported by the package
(see ``ferrogrpc/__init__.py``): importing it registers the
torch.distributed backend."""

from __future__ import annotations

from . import testing, torch_backend
from .backend import Backend
from .ddp import DDP
from .fsdp import FSDP
from .ops import SUPPORTED_DTYPES, ReduceOp
from .peer import Peer
from .startup import init_backend
from .work import Work

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
