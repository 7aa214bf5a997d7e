"""``Work``: a collective in flight, as ``async_op=True`` returns it."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Generic, TypeVar

import torch

from ..errors import CollectiveTimeoutError, FerroGrpcError

T = TypeVar("T")

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _completions() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that complete torch futures (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ferrogrpc-done")
        return _pool


class Work(Generic[T]):
    """A collective in flight, as returned with ``async_op=True``.

    ``wait()`` blocks until it finishes and returns what the blocking call
    would have returned, or raises its error. Several Works may be in flight
    at once, from any threads.
    """

    def __init__(self, future: concurrent.futures.Future[T], name: str) -> None:
        self._future = future
        self._name = name

    def wait(self, timeout: float | None = None) -> T:
        """Wait for the result. With ``timeout``, raise CollectiveTimeoutError if
        it has not finished by then (the collective itself goes on)."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            # That is the builtin TimeoutError, which CollectiveTimeoutError
            # also is: the collective's own error passes through as it is.
            if isinstance(exc, FerroGrpcError):
                raise
            raise CollectiveTimeoutError(
                f"Work.wait timed out after {timeout:g}s; the collective is still running",
                op=self._name,
            ) from None

    def is_completed(self) -> bool:
        """Whether the collective has ended, done or failed (never blocks)."""
        return self._future.done()

    def when_done(self) -> concurrent.futures.Future[float]:
        """A future of the ``time.perf_counter()`` at which this finished
        (however it finished)."""
        stamp: concurrent.futures.Future[float] = concurrent.futures.Future()
        self._future.add_done_callback(lambda _: stamp.set_result(time.perf_counter()))
        return stamp

    def get_future(self) -> torch.futures.Future[T]:
        """A ``torch.futures.Future`` completed with the result (or the
        error) when the collective finishes, as torch's ``Work.get_future()``
        is: DDP communication hooks chain on it."""
        source: torch.futures.Future[T] = torch.futures.Future()

        def complete(f: concurrent.futures.Future[T]) -> None:
            exc = f.exception()
            if exc is not None:
                source.set_exception(exc)  # type: ignore[arg-type]
            else:
                source.set_result(f.result())

        def done(f: concurrent.futures.Future[T]) -> None:
            # Off the backend's loop thread: callbacks chained on the torch
            # future run where it completes, and may start collectives.
            _completions().submit(complete, f)

        self._future.add_done_callback(done)
        # set_exception stores the error as the future's *value* (unwrapped
        # only in Python), so C++ code reading the future (torch DDP's reducer
        # takes a comm hook's result) saw a result with no tensors, and the
        # process died with SIGSEGV. A future chained with then() whose
        # callback raises is failed in C++ itself: torch raises there.
        return source.then(_unwrap)

    def exception(self) -> BaseException | None:
        """The error, once completed (None on success)."""
        return self._future.exception() if self._future.done() else None


def _unwrap(fut: torch.futures.Future[T]) -> T:
    """The result, or (for a failed collective) its error, raised."""
    return fut.value()
