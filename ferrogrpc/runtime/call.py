"""The call object: one collective, numbered and placed, that a caller
awaits on the loop or runs in its own thread (see [Note: one path per
collective] in engine.py)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Generator
from typing import Any, Protocol, TypeVar

from ..algorithms.jobs import Job
from .placement import Placed

T = TypeVar("T")
U = TypeVar("U")


class Runs(Protocol):
    """Where a call runs: the rank's Engine."""

    async def run(self, job: Job) -> None: ...

    def run_here(self, job: Job) -> bool: ...


class Call(Coroutine[Any, Any, T]):
    """A collective a Peer method returns. Awaited, it runs on the loop
    (:meth:`Engine.run`); a synchronous caller (Backend, the torch process
    group) may first try :meth:`run_here`, which runs a small collective on
    one host in the calling thread when its turn has come, as gloo does:
    no hand-off to the loop and back. Either way it then copies the result
    back (``placed.after()``) and returns ``result()``."""

    def __init__(self, engine: Runs, placed: Placed, result: Callable[[], T]) -> None:
        self._engine = engine
        self._placed: Placed | None = placed
        self._result: Callable[[], T] | None = result
        self._coro = self._run()

    def _spend(self) -> tuple[Placed, Callable[[], T]]:
        """The job and its result, which this call then no longer holds: a
        call outlives its collective (a task keeps its coroutine, and a
        ``Work`` the task behind it, as FSDP's reduce-scatters wait until
        the end of backward), and the job's buffers must not (a layer's
        whole gradient each)."""
        placed, result = self._placed, self._result
        if placed is None or result is None:
            raise RuntimeError("this collective's call was already run")
        self._placed = self._result = None
        return placed, result

    async def _run(self) -> T:
        placed, result = self._spend()
        await self._engine.run(placed.job)
        placed.after()
        return result()

    def run_here(self) -> tuple[bool, T | None]:
        """Run the collective in this thread if it can: (True, its result),
        or (False, None) to await it instead. Raises what the collective
        raises."""
        placed = self._placed
        if placed is None:
            raise RuntimeError("this collective's call was already run")
        try:
            done = self._engine.run_here(placed.job)
        except BaseException:
            self._coro.close()
            self._spend()
            raise
        if not done:
            return False, None
        self._coro.close()
        placed, result = self._spend()
        placed.after()
        return True, result()

    def returning(self, result: Callable[[], U]) -> Call[U]:
        """The same collective, returning ``result()`` instead (this call is
        spent: use the one returned)."""
        self._coro.close()
        placed, _ = self._spend()
        return Call(self._engine, placed, result)

    # The coroutine protocol, delegated to the loop's path.

    def send(self, value: Any) -> Any:
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        return self._coro.throw(*args)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, T]:
        return self._coro.__await__()
