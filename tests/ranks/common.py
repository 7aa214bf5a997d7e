"""Shared pieces of the rank programs: data, optimizers, comparison, and
waiting for the test's go-ahead."""

from __future__ import annotations

import time
from pathlib import Path

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


def wait_for_release(outdir: Path, timeout: float = 60.0) -> None:
    """Wait until the test creates ``outdir/release`` (at most ``timeout``
    seconds): a rank that must stay up while the test looks at it."""
    deadline = time.monotonic() + timeout
    while not (outdir / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
