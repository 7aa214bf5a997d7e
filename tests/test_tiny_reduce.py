"""The small path's Python reduction of tiny float tensors (exchange_plan.py's
``_reduce_tiny``) gives bitwise what torch's own adds give: every rank's
values added in rank order, one float32 (or float64) add at a time, then
divided by the world size for a mean. The reference is torch itself."""

from __future__ import annotations

import math

import pytest
import torch

from ferrogrpc.algorithms.exchange_plan import TINY_ELEMS, _reduce_tiny
from ferrogrpc.ops import ReduceOp
from ferrogrpc.transport.wire import bytes_view

pytestmark = pytest.mark.timeout(60)

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).smallest_normal


def _torch_reference(rows: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    acc = rows[0].clone()
    for row in rows[1:]:
        torch.add(acc, row, out=acc)
    if op is ReduceOp.MEAN:
        acc.div_(len(rows))
    return acc


def _tiny(rows: list[torch.Tensor], rank: int, op: ReduceOp) -> tuple[bool, torch.Tensor]:
    """Run _reduce_tiny as ``rank`` would: its own row in place, the
    others' as the bytes it received."""
    buf = rows[rank].clone()
    got = {
        r: memoryview(row.view(torch.uint8).numpy().tobytes())
        for r, row in enumerate(rows)
        if r != rank
    }
    return _reduce_tiny(buf, rank, len(rows), got, op), buf


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))
    return bool(torch.equal(a.view(torch.int64), b.view(torch.int64)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_tiny_reduction_matches_torch_bitwise_on_every_rank(
    dtype: torch.dtype, op: ReduceOp, world: int
) -> None:
    gen = torch.Generator().manual_seed(world)
    for trial in range(200):
        n = 1 + trial % TINY_ELEMS
        # Mixed magnitudes, so that most adds round.
        scale = torch.pow(10.0, torch.randint(-30, 30, (world, n), generator=gen).to(dtype))
        rows = list((torch.randn(world, n, generator=gen, dtype=dtype) * scale).unbind())
        expected = _torch_reference(rows, op)
        for rank in range(world):
            done, got = _tiny(rows, rank, op)
            assert done
            assert _same_bits(got, expected), (trial, rank, got, expected)


def test_tiny_reduction_rounds_after_every_add() -> None:
    # In double, (1 + 2^-24) + 2^-24 is exact; in float32 each add rounds to
    # 1, so the float32 sum is 1 and not 1 + 2^-23.
    eps = 2.0**-24
    rows = [torch.tensor([1.0]), torch.tensor([eps]), torch.tensor([eps])]
    done, got = _tiny(rows, 0, ReduceOp.SUM)
    assert done and got.item() == 1.0 == _torch_reference(rows, ReduceOp.SUM).item()


@pytest.mark.parametrize(
    "values",
    [
        [F32_MAX, F32_MAX],  # overflows: torch computes inf
        [float("inf"), 1.0],
        [float("-inf"), float("inf")],  # nan
        [float("nan"), 0.0],
        [-0.0, -0.0],
        [-0.0, 0.0],
        [F32_TINY / 8, F32_TINY / 8],  # subnormals
        [F32_MAX, -F32_MAX],
    ],
)
def test_tiny_reduction_edge_values_match_torch(values: list[float]) -> None:
    rows = [torch.tensor([v], dtype=torch.float32) for v in values]
    expected = _torch_reference(rows, ReduceOp.SUM)
    for rank in range(len(rows)):
        done, got = _tiny(rows, rank, ReduceOp.SUM)
        if not done:  # left to torch: the buffer is untouched
            assert math.isinf(expected.item()) and torch.equal(got, rows[rank])
            continue
        if math.isnan(expected.item()):
            assert math.isnan(got.item())
        else:
            assert _same_bits(got, expected), (values, got, expected)


def test_tiny_reduction_leaves_other_cases_to_torch() -> None:
    rows = [torch.ones(3, dtype=torch.float32), torch.ones(3, dtype=torch.float32)]
    assert not _tiny(rows, 0, ReduceOp.MAX)[0]
    assert not _tiny([torch.ones(TINY_ELEMS + 1)] * 2, 0, ReduceOp.SUM)[0]
    assert not _tiny([torch.ones(2, dtype=torch.int64)] * 2, 0, ReduceOp.SUM)[0]
    assert not _tiny([torch.ones(2, dtype=torch.bfloat16)] * 2, 0, ReduceOp.SUM)[0]
    assert not _tiny([torch.ones(0)] * 2, 0, ReduceOp.SUM)[0]


def test_tiny_reduction_bumps_the_version_counter() -> None:
    buf = torch.ones(2)
    before = buf._version
    got = {1: memoryview(torch.ones(2).numpy().tobytes())}
    assert _reduce_tiny(buf, 0, 2, got, ReduceOp.SUM)
    assert buf._version > before and buf.tolist() == [2.0, 2.0]
    assert bytes_view(buf).nbytes == 8
