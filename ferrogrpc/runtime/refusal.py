"""Refused calls: a collective whose own argument checks fail on one rank.

Every collective is a synchronization point, so a call that this rank
refuses (a bad dtype, op, root, size or tensor layout; see validate.py)
still takes its collective's sequence number, and every other rank is told:
each fails that collective at once with a ConfigError naming this rank and
the message, instead of waiting for this rank until the deadline. No data
moves. Every rank's sequence moved alike, so the group stays usable (see
failure/policy.py for the one exception). The refusing rank raises its own error,
carrying the sequence number.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from ..algorithms.jobs import JobTable
from ..errors import ConfigError, FerroGrpcError
from ..failure.policy import FailurePolicy
from ..lifecycle import Lifecycle


class CallChecks:
    """Runs a rank's argument checks (:meth:`run`). Built on the rank's
    event loop; used from any thread. A refusal takes its sequence numbers
    in ``jobs``, is built by ``failure``, and is handed to ``tell`` on the
    loop (which tells every rank and drops what arrives for it). A peer
    that ``life`` says is closing or broken refuses alone: nobody is
    waiting for it."""

    def __init__(
        self,
        jobs: JobTable,
        failure: FailurePolicy,
        life: Lifecycle,
        tell: Callable[[list[FerroGrpcError]], None],
    ) -> None:
        self._jobs = jobs
        self._failure = failure
        self._life = life
        self._tell = tell
        self._loop = asyncio.get_running_loop()

    @contextlib.contextmanager
    def run(self, name: str, count: Callable[[], int] | None = None) -> Iterator[None]:
        """Run the checks of collective ``name`` inside this block. If they
        raise (ConfigError, or TypeError for a non-tensor), the call takes
        ``count()`` sequence numbers (one per collective it would have run;
        default one), the other ranks are told, and the error raises on."""
        try:
            yield
        except (ConfigError, TypeError) as exc:
            seqs = self._refuse(name, exc, count() if count is not None else 1)
            if seqs and isinstance(exc, FerroGrpcError) and exc.seq is None:
                exc.seq = seqs[0]
            raise

    def _refuse(self, name: str, exc: Exception, count: int) -> list[int]:
        me = self._failure.identity
        if me.world_size == 1 or self._life.closing or self._life.broken is not None:
            return []
        message = exc.message if isinstance(exc, FerroGrpcError) else f"{type(exc).__name__}: {exc}"
        errors = self._jobs.refuse(
            lambda seq: self._failure.refusal_error(name, seq, message), count
        )
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody left to tell
            self._loop.call_soon_threadsafe(self._tell, list[FerroGrpcError](errors))
        return [err.seq for err in errors if err.seq is not None]


def group_count(tensors: Sequence[object]) -> int:
    """How many collectives all_reduce_coalesced runs for ``tensors``: one
    per (dtype, device) among them."""
    keys = {(str(t.dtype), str(t.device)) for t in tensors if isinstance(t, torch.Tensor)}
    return max(1, len(keys))
