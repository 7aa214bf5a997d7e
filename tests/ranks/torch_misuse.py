"""A rank program: every list-form op of torch.distributed misused on rank 0
(a wrong shape, a wrong list length), over the ``ferrogrpc`` backend. Rank 0
must raise at once; every other rank must fail the same op at once with a
ConfigError naming rank 0; and a broadcast right after must still pair up
(nothing is misaligned). gloo refuses these misuses too (checked on rank 0
alone: gloo's checks run before it communicates), but for reduce_scatter,
which gloo starts and then waits in. Prints ``OK <case>`` lines and
``DONE``."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import ferrogrpc as fg

FAST_S = 3.0
# gloo starts a misused list-form reduce_scatter and waits for the others
# (which then fail or hang): it has no local check to compare with.
GLOO_WAITS = {"reduce_scatter"}


def misuses(rank: int, world: int) -> dict[str, Callable[[dist.ProcessGroup | None], object]]:
    x = torch.arange(4, dtype=torch.float32) + rank
    wrong = rank == 0

    def scatter(group: dist.ProcessGroup | None) -> object:
        out = torch.empty(4)
        parts = [torch.ones(4) for _ in range(world)] if rank == 0 else None
        if wrong and parts is not None:
            parts[1] = torch.ones(5)  # a wrong-sized tensor in the root's scatter_list
        return dist.scatter(out, parts, src=0, group=group)

    def all_gather(group: dist.ProcessGroup | None) -> object:
        outs = [torch.empty((2, 4) if wrong else (4,)) for _ in range(world)]
        return dist.all_gather(outs, x, group=group)

    def all_gather_length(group: dist.ProcessGroup | None) -> object:
        outs = [torch.empty(4) for _ in range(world + (1 if wrong else 0))]
        return dist.all_gather(outs, x, group=group)

    def gather(group: dist.ProcessGroup | None) -> object:
        outs = [torch.empty(5 if wrong else 4) for _ in range(world)] if rank == 0 else None
        return dist.gather(x, outs, dst=0, group=group)

    def reduce_scatter(group: dist.ProcessGroup | None) -> object:
        out = torch.empty(4)
        parts = [torch.ones(3 if wrong and r == 1 else 4) for r in range(world)]
        return dist.reduce_scatter(out, parts, group=group)

    def all_to_all(group: dist.ProcessGroup | None) -> object:
        outs = [torch.empty(4) for _ in range(world)]
        ins = [torch.ones(4) for _ in range(world - (1 if wrong else 0))]
        return dist.all_to_all(outs, ins, group=group)

    return {
        "scatter": scatter,
        "all_gather": all_gather,
        "all_gather_length": all_gather_length,
        "gather": gather,
        "reduce_scatter": reduce_scatter,
        "all_to_all": all_to_all,
    }


def main() -> None:
    dist.init_process_group("ferrogrpc")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    cases = misuses(rank, world)
    for name, call in cases.items():
        if rank == 0 and name not in GLOO_WAITS:
            try:
                call(gloo)
            except (RuntimeError, ValueError):
                pass
            else:
                raise AssertionError(f"{name}: gloo accepted the misuse")
        start = time.monotonic()
        try:
            call(None)
        except (RuntimeError, ValueError) as exc:
            took = time.monotonic() - start
            assert took < FAST_S, (name, took, exc)
            if rank != 0:
                assert isinstance(exc, fg.ConfigError), (name, type(exc), exc)
                assert "rank 0" in str(exc), (name, str(exc))
        else:
            raise AssertionError(f"{name}: rank {rank} returned without an error")
        # Still paired: the next collective is the same one everywhere.
        t = torch.full((3,), float(rank))
        dist.broadcast(t, src=0)
        assert t.tolist() == [0.0, 0.0, 0.0], (name, t)
        sys.stdout.write(f"OK {name}\n")
        sys.stdout.flush()
    # The others' Work of a refused op: completed, failed, and says so.
    outs = [torch.empty((2, 4) if rank == 0 else (4,)) for _ in range(world)]
    x = torch.ones(4)
    if rank == 0:
        with contextlib.suppress(ValueError):
            dist.all_gather(outs, x)
    else:
        work = dist.all_gather(outs, x, async_op=True)
        assert work is not None
        try:
            work.wait()
        except fg.ConfigError:
            pass
        else:
            raise AssertionError("a refused op's Work waited without an error")
        assert work.is_completed() and not work.is_success(), "is_success() of a failed op"
        assert work.exception() is not None
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=0)
    assert t.tolist() == [0.0, 0.0, 0.0]
    sys.stdout.write("OK work\n")
    # monitored_barrier with the last rank late: rank 0 names it in time,
    # the others name rank 0, whose answer never came (as gloo's does).
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))  # all present
    timeout = 0.5
    if rank == world - 1:
        time.sleep(timeout + 0.5)
    else:
        start = time.monotonic()
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout))
        except fg.CollectiveTimeoutError as exc:
            took = time.monotonic() - start
            assert timeout <= took < timeout + 1.0, took
            culprit = world - 1 if rank == 0 else 0
            assert exc.peer == culprit and f"rank {culprit}" in str(exc), str(exc)
        else:
            raise AssertionError("monitored_barrier returned with a rank absent")
    sys.stdout.write("OK monitored_barrier\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    sys.stdout.write("DONE\n")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Closed already: end now, without torch's exit-time destructors (0.7 s
    # of CPU a process, which the suite would pay hundreds of times).
    os._exit(0)
