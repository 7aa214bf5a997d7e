"""Registering ``"ferrogrpc"`` with torch.distributed, without importing
torch ourselves (see [Note: import without torch]).

[Note: import without torch] ``import ferrogrpc`` must not import torch:
the coordinator, its container healthcheck and ``ferrogrpc status`` use no
torch, and importing it costs seconds of CPU (every 2 s, as a
healthcheck). So the package loads its torch-using names on first use, and
registers the backend with torch.distributed as soon as torch itself is
loaded: at once when it already is, else the moment ``import torch``
finishes (a one-shot import hook on the ``torch`` package: import_hook.py). The
registration imports nothing of ours: the process group is built, and its
module imported, only when torch asks for one
(``dist.init_process_group("ferrogrpc")``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ..import_hook import around_first_import

NAME = "ferrogrpc"
_lock = threading.Lock()


def _create(*args: Any, **kwargs: Any) -> Any:
    from .process_group import create

    return create(*args, **kwargs)


def register() -> None:
    """Register ``"ferrogrpc"`` with torch.distributed (once per process),
    and extend ``dist.monitored_barrier`` to its groups (torch implements it
    for gloo only). torch must be loaded."""
    import torch.distributed as dist

    with _lock:
        if NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        torch_barrier = dist.monitored_barrier

        def monitored_barrier(
            group: Any = None, timeout: Any = None, wait_all_ranks: bool = False
        ) -> None:
            from .process_group import monitored_barrier as ours

            ours(torch_barrier, group, timeout, wait_all_ranks)

        monitored_barrier.__doc__ = torch_barrier.__doc__
        dist.monitored_barrier = monitored_barrier
        dist.distributed_c10d.monitored_barrier = monitored_barrier


@contextlib.contextmanager
def _register_after() -> Iterator[None]:
    """Around torch's first import: register once it has loaded."""
    yield
    register()


def register_when_torch_loads() -> None:
    """Register now if torch is loaded, else as soon as it is."""
    if not around_first_import("torch", _register_after):
        register()
