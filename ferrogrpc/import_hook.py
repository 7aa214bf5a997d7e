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
    """Finds nothing itself: every spec the other finders return for
    ``name`` gets its loader's ``exec_module`` wrapped, so that the first
    of them to run the module's body runs it inside ``around()``. Only an
    execution fires it: ``importlib.util.find_spec(name)`` (an "is it
    installed?" probe, as transformers makes for torch) leaves it armed.
    When it fires it steps aside, and each wrapped loader is put back as
    it was when it next runs."""

    def __init__(self, name: str, around: Around) -> None:
        self.name = name
        self.around = around
        self.fired = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            if (spec := find(fullname, path, target)) is not None:
                break
        loader = None if spec is None else spec.loader
        # A loader instance of its own (a file's): a class, or one without
        # exec_module, would be patched for every module it loads.
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_around(module: ModuleType) -> None:
            with contextlib.suppress(AttributeError):
                del loader.exec_module  # the class's again
            if not self._claim():
                exec_module(module)
                return
            with self.around():
                exec_module(module)

        loader.exec_module = exec_around  # type: ignore[method-assign]
        return spec

    def _claim(self) -> bool:
        """The first execution only: fire, and step aside."""
        with _lock:
            if self.fired:
                return False
            self.fired = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            return True


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
