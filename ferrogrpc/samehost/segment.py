"""A rank's shared segment (a ``memfd``), and one made ahead of need.

[Note: a segment made ahead]
A new segment's pages are allocated by their first write: 8k page faults
for 32 MiB, 10-11 ms of kernel work on the 2-core VM, paid inside the first
collective that crosses it, where every rank of the ring waits for the
slowest. A fixed group pays it once. An elastic group paid it at every
change of epoch, on the path from a death or a join to the next step: a new
3-rank group's first 33.6 MB all_reduce took 0.058-0.066 s against
0.018-0.023 s for the next ones, and 0.023-0.028 s with the segment touched
before. So an elastic backend keeps one segment made and touched ahead, by a
thread, between its changes of epoch (:class:`Spare`), and its next epoch's
plane takes it: a member whose epoch has ranks on its host makes one after
each change, as does a lone member (its next epoch admits a joiner, often a
process restarted beside it), and a joiner while it waits to be admitted.
The price is one more segment's memory (32 MiB) while training, and a
joiner that finds no member on its host holds its spare unused for its
first epoch. Measured with ``client.bench --elastic`` at 100 MB (four runs
each, alternated, the joiner's heap warm in both: runtime/allocator.py):
the members' pause at a join was 0.105-0.127 s instead of 0.131-0.141.
The making is paid once per change of epoch, in the first step after it:
7.5-11 ms of CPU for 32 MiB on an idle core, 16-52 ms in each process of a
3-rank group at 400 MB whose joiner had just arrived (2 cores).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
import threading

import torch

# Linux's MADV_POPULATE_WRITE (5.14+; not named by Python's mmap here): maps
# every page writable in one call. On 32 MiB of the 2-core VM it took 7.5-7.8
# ms of CPU where writing every byte took 8-11, and a full write after it 1.0
# ms instead of 1.9-2.4.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class Segment:
    """``nbytes`` of anonymous shared memory (a memfd, closed on exec), mapped
    read-write here; :attr:`tensor` views it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("ferrogrpc", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def touch(self) -> Segment:
        """Fault every page in now, writable (see [Note: a segment made
        ahead]): one madvise(MADV_POPULATE_WRITE) where the kernel has it
        (Linux 5.14), else a write of every byte."""
        try:
            self.map.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError, AttributeError):
            self.tensor.fill_(0)
        return self

    def release(self) -> None:
        """Unmap it and close its descriptor (a segment no plane took)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        unmap([self.map], self.fd)


def unmap(maps: list[mmap.mmap], fd: int) -> None:
    """Unmap ``maps`` and close ``fd`` (when not negative)."""
    for mapped in maps:
        # A tensor may still view it: it is then freed with the last reference.
        with contextlib.suppress(BufferError):
            mapped.close()
    if fd >= 0:
        os.close(fd)


def _release(future: concurrent.futures.Future[Segment]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release()


class Spare:
    """At most one segment, made and touched ahead by a thread (see [Note: a
    segment made ahead]). :meth:`take` hands it over once it is ready; one
    still being made, or of another size, is released instead."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future[Segment] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def prepare(self, nbytes: int) -> None:
        """Start making one of ``nbytes``, unless one is made or being made."""
        with self._lock:
            if self._future is not None or self._closed:
                return
            future: concurrent.futures.Future[Segment] = concurrent.futures.Future()
            self._future = future

        def make() -> None:
            try:
                future.set_result(Segment(nbytes).touch())
            except BaseException as exc:  # no segment: the plane makes its own
                future.set_exception(exc)

        try:
            threading.Thread(target=make, name="ferrogrpc-segment", daemon=True).start()
        except RuntimeError:  # no new threads: the interpreter is exiting
            future.cancel()

    def take(self, nbytes: int) -> Segment | None:
        """The spare segment, if one of ``nbytes`` is ready; None otherwise."""
        with self._lock:
            future, self._future = self._future, None
        if future is None:
            return None
        if not future.done():
            future.add_done_callback(_release)
            return None
        if future.cancelled() or future.exception() is not None:
            return None
        segment = future.result()
        if segment.nbytes != nbytes:
            segment.release()
            return None
        return segment

    def close(self) -> None:
        """Release the spare, now or once it is made; prepare nothing more."""
        with self._lock:
            self._closed = True
            future, self._future = self._future, None
        if future is not None:
            future.add_done_callback(_release)
