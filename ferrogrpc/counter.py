"""A monotonic counter that coroutines can wait on, and that can fail."""

from __future__ import annotations

import asyncio


class Counter:
    """Counts up; ``wait_for(n)`` returns once it has reached ``n``. After
    ``fail(exc)``, every pending and later wait that is not already satisfied
    raises ``exc``."""

    __slots__ = ("_error", "_waiters", "value")

    def __init__(self) -> None:
        self.value = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._error: BaseException | None = None

    def advance(self) -> None:
        self.advance_to(self.value + 1)

    def advance_to(self, value: int) -> None:
        if value <= self.value:
            return
        self.value = value
        if self._waiters:
            keep = []
            for threshold, fut in self._waiters:
                if threshold <= value:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((threshold, fut))
            self._waiters = keep

    def fail(self, exc: BaseException) -> None:
        if self._error is not None:
            return
        self._error = exc
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: the waiter re-raises it
        self._waiters = []

    async def wait_for(self, threshold: int) -> None:
        if self.value >= threshold:
            return
        if self._error is not None:
            raise self._error
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((threshold, fut))
        await fut
