"""A collective's ``Work`` outlives the collective (FSDP keeps each
reduce-scatter's until the end of backward): once done, it must not keep the
collective's buffers alive. It did, through the task behind it, its call
object and the job: FSDP with units held every layer's whole gradient
through backward (peak RSS 853 MiB against 593, ``bench_train --wrapper
fsdp``)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import ferrogrpc as fg
from tests.helpers import backends, on_ranks

pytestmark = pytest.mark.timeout(60)


def _issue(b: fg.Backend, op: str, numel: int, world: int) -> tuple[Any, torch.Tensor]:
    """Start ``op`` on rank ``b`` with fresh tensors; returns its Work and the
    output, the input referenced by nothing else."""
    if op == "all_reduce":
        inp = torch.ones(numel)
        return b.all_reduce(inp, async_op=True), inp  # in place: the input is the output
    if op == "reduce_scatter":
        out = torch.empty(numel // world)
        return b.reduce_scatter_tensor(out, torch.ones(numel), "sum", async_op=True), out
    out = torch.empty(numel * world)
    return b.all_gather_into_tensor(out, torch.ones(numel), async_op=True), out


@pytest.mark.parametrize("numel", [64, 1 << 20])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_a_finished_work_holds_no_buffer_of_its_collective(op: str, numel: int) -> None:
    world = 2
    group = backends(world)
    try:
        inputs: list[StorageWeakRef] = []
        works: list[Any] = []

        def rank(r: int) -> torch.Tensor:
            work, out = _issue(group[r], op, numel, world)
            works.append(work)
            work.wait()
            return out

        def watch(issue: Callable[..., Any]) -> Callable[..., Any]:
            def issued(*args: Any, **kwargs: Any) -> Any:
                # The input's storage (out, input, ...): the job holds views of it.
                inputs.append(StorageWeakRef(args[1].untyped_storage()))  # type: ignore[no-untyped-call]
                return issue(*args, **kwargs)

            return issued

        for b in group:
            name = "reduce_scatter_tensor" if op == "reduce_scatter" else "all_gather_into_tensor"
            setattr(b, name, watch(getattr(b, name)))
        outs = on_ranks(rank, world)
        gc.collect()
        assert len(works) == world and all(w.is_completed() for w in works)
        # The results are right, and the inputs are gone though the Works live.
        expected = float(world) if op == "reduce_scatter" else 1.0
        assert all(torch.equal(o, torch.full_like(o, expected)) for o in outs)
        assert [ref.expired() for ref in inputs] == [True] * world  # type: ignore[no-untyped-call]
    finally:
        for b in group:
            b.close()
