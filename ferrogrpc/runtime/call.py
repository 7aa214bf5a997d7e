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
        self._placed = placed
        self._result = result
        self._coro = self._run()

    async def _run(self) -> T:
        await self._engine.run(self._placed.job)
        self._placed.after()
        return self._result()

    def run_here(self) -> tuple[bool, T | None]:
        """Run the collective in this thread if it can: (True, its result),
        or (False, None) to await it instead. Raises what the collective
        raises."""
        try:
            done = self._engine.run_here(self._placed.job)
        except BaseException:
            self._coro.close()
            raise
        if not done:
            return False, None
        self._coro.close()
        self._placed.after()
        return True, self._result()

    def returning(self, result: Callable[[], U]) -> Call[U]:
        """The same collective, returning ``result()`` instead (this call is
        spent: use the one returned)."""
        self._coro.close()
        return Call(self._engine, self._placed, result)

    # The coroutine protocol, delegated to the loop's path.

    def send(self, value: Any) -> Any:
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        return self._coro.throw(*args)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, T]:
        return self._coro.__await__()
