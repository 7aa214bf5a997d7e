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
The price is one more segment's memory (32 MiB) while training, two while
a joiner waits; a process whose epoch has one rank a host holds none after
its first step there. Measured with ``client.bench --elastic`` at 100 MB
(four runs each, alternated, the joiner's heap warm in both:
runtime/allocator.py): the members' pause at a join was 0.105-0.127 s
instead of 0.131-0.141.
The making cost 7.5-11 ms of CPU for 32 MiB on an idle core, and 16-52 ms
in each process of a 3-rank group at 400 MB whose joiner had just arrived
(2 cores), when every process made its next spare in the first step after
each change of epoch. A member no longer makes one then (below); a joiner
makes two while it waits, so it makes none either.

[Note: a segment handed back]
A member's closed epoch leaves its own segment, every page of it already
faulted in: the plane hands it to the Spare (:meth:`Spare.give`), instead
of unmapping it, and it becomes the spare of the epoch after the next one
(the next takes the spare made ahead, the oldest held). So a member makes
no segment after a change of epoch. Two facts make the reuse safe:
- only this process writes its own segment (the local peers map it
  read-only), and only from its collectives' tasks on the loop; a peer's
  close cancels them before the plane closes, and a cancelled task raises
  at its next await, before it writes again. A stalled peer of the old
  epoch that wakes may still read the segment: what it computes is
  discarded when it joins again (its state comes from the members);
- nothing reads a segment before its writer signals the slot written, so
  the old epoch's bytes left in it are never taken for data.
Measured with ``client.bench --elastic`` at 100 MB, three members (six runs
each, alternated), with no spare made in the first steps after a join the
members' pause was 0.096-0.124 s instead of 0.126-0.143.
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


# The most segments a Spare holds: the one a member made ahead for its next
# epoch, and the one its closed epoch's plane handed back until that next
# epoch's plane takes the first (see [Note: a segment handed back]).
HELD = 2


class Spare:
    """Segments held for this process's next epochs (see [Note: a segment
    made ahead]): at most ``HELD``, each made and touched ahead by a thread,
    or handed back by a closed plane (:meth:`give`). :meth:`take` hands over
    the oldest that is ready; one still being made stays for the next."""

    def __init__(self) -> None:
        self._held: list[concurrent.futures.Future[Segment]] = []
        self._lock = threading.Lock()
        self._closed = False

    def prepare_next(self, nbytes: int, joining: bool, local: bool) -> None:
        """Have the next epoch's segment made ahead: on a joiner (which may
        share its host with members), and on a member whose epoch has ranks
        on its host or is alone (``local``: its next epoch admits a joiner
        that may be a process restarted beside it). A member of a group
        spread over hosts, one a host, makes none and holds none: its next
        epoch is unlikely to have ranks on its host."""
        if joining:
            # Also the one after: a joiner has no epoch's own segment to
            # hand back (see [Note: a segment handed back]), and its cores
            # are free while it waits.
            self.prepare(nbytes, count=2)
        elif local:
            self.prepare(nbytes)
        else:  # none kept either (a joiner's second, one handed back)
            self.drop()

    def prepare(self, nbytes: int, count: int = 1) -> None:
        """Start making segments of ``nbytes`` until ``count`` are held or
        being made (one thread makes them in turn)."""
        with self._lock:
            if self._closed:
                return
            futures: list[concurrent.futures.Future[Segment]] = [
                concurrent.futures.Future() for _ in range(min(count, HELD) - len(self._held))
            ]
            self._held += futures
        if not futures:
            return

        def make() -> None:
            for future in futures:
                try:
                    future.set_result(Segment(nbytes).touch())
                except BaseException as exc:  # no segment: the plane makes its own
                    future.set_exception(exc)

        try:
            threading.Thread(target=make, name="ferrogrpc-segment", daemon=True).start()
        except RuntimeError:  # no new threads: the interpreter is exiting
            for future in futures:
                future.cancel()

    def give(self, segment: Segment) -> bool:
        """Hold ``segment``, a closed plane's own, for a next epoch (see
        [Note: a segment handed back]). False if it is not held (this spare
        is closed, or holds ``HELD``): the caller releases it."""
        future: concurrent.futures.Future[Segment] = concurrent.futures.Future()
        future.set_result(segment)
        with self._lock:
            if self._closed or len(self._held) >= HELD:
                return False
            self._held.append(future)
        return True

    def take(self, nbytes: int) -> Segment | None:
        """The oldest held segment that is ready, if it is of ``nbytes``;
        None otherwise. A failed one is dropped, one of another size
        released."""
        while True:
            with self._lock:
                ready = next((f for f in self._held if f.done()), None)
                if ready is None:
                    return None
                self._held.remove(ready)
            if ready.cancelled() or ready.exception() is not None:
                continue
            segment = ready.result()
            if segment.nbytes == nbytes:
                return segment
            segment.release()

    def drop(self) -> None:
        """Release every held segment, now or once it is made."""
        with self._lock:
            held, self._held = self._held, []
        for future in held:
            future.add_done_callback(_release)

    def close(self) -> None:
        """Release every held segment, now or once it is made; hold nothing
        more."""
        with self._lock:
            self._closed = True
        self.drop()
