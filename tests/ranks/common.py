"""Shared pieces of the wrapper rank programs: data, optimizers, comparison."""

from __future__ import annotations

import torch
from torch import nn


def batch(
    step: int, rows: int, cols_in: int, cols_out: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randn(rows, cols_in, generator=g, dtype=torch.float64)
    return x, torch.randn(rows, cols_out, generator=g, dtype=torch.float64)


def make_opt(name: str, params: object) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
