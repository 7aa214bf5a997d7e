"""The reductions a received part is combined with: ``out = a (op) b``,
one torch op per ReduceOp (torch releases the GIL while it runs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops import ReduceOp

Reducer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

# Reductions applied to a received chunk: out = a (op) b.
REDUCERS: dict[ReduceOp, Reducer] = {
    ReduceOp.SUM: lambda a, b, out: torch.add(a, b, out=out),
    ReduceOp.MEAN: lambda a, b, out: torch.add(a, b, out=out),
    ReduceOp.MAX: lambda a, b, out: torch.maximum(a, b, out=out),
    ReduceOp.MIN: lambda a, b, out: torch.minimum(a, b, out=out),
    ReduceOp.PRODUCT: lambda a, b, out: torch.mul(a, b, out=out),
    ReduceOp.BAND: lambda a, b, out: torch.bitwise_and(a, b, out=out),
    ReduceOp.BOR: lambda a, b, out: torch.bitwise_or(a, b, out=out),
    ReduceOp.BXOR: lambda a, b, out: torch.bitwise_xor(a, b, out=out),
}
