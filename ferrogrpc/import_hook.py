"""Code around a module's first import, without importing it: a one-shot
meta-path finder. wrappers/registration.py registers the backend once torch
has loaded; transport/grpc_tuning.py sets gRPC's experiments for the moment
grpc loads."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

Around = Callable[[], contextlib.AbstractContextManager[None]]

_lock = threading.Lock()


class _AroundImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``name`` is first imported, it wraps the
    real loader so that the module's body runs inside ``around()``, then
    steps aside."""

    def __init__(self, name: str, around: Around) -> None:
        self.name = name
        self.around = around

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        self.remove()
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(fullname, path, target)) is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        around = self.around

        def exec_around(module: ModuleType) -> None:
            with around():
                exec_module(module)

        loader.exec_module = exec_around  # type: ignore[method-assign]
        return spec

    def remove(self) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def around_first_import(name: str, around: Around) -> bool:
    """Run the top-level module ``name``'s body inside ``around()`` when it
    is first imported (an exception from the body passes through the
    context manager, as in a ``with``). Returns False, doing nothing, when
    ``name`` is already loaded; a second call for a name still waiting adds
    nothing either."""
    with _lock:
        if name in sys.modules:
            return False
        if not any(isinstance(f, _AroundImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _AroundImport(name, around))
    return True
