"""The model fingerprint check both wrappers run when they are built: the
ranks must wrap the same parameters (names, shapes, dtypes) and, where the
wrapper has one, the same layout, or every rank raises a ConfigError naming
the first difference."""

from __future__ import annotations

import json
from typing import Protocol

import torch
from torch import nn

from ..errors import ConfigError


class Gathers(Protocol):
    """What the check needs of a Backend."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


def _fingerprint(module: nn.Module) -> list[str]:
    return [
        f"{name}: shape={tuple(p.shape)} dtype={str(p.dtype).removeprefix('torch.')} "
        f"requires_grad={p.requires_grad}"
        for name, p in module.named_parameters()
    ]


def check_same_model(
    module: nn.Module, backend: Gathers, what: str, extra: list[str] | None = None
) -> None:
    """Raise ConfigError on every rank if the ranks' parameter names, shapes
    or dtypes differ, or their ``extra`` lines (a wrapper's layout), naming
    the first difference and both ranks' versions."""
    params = _fingerprint(module)
    entries = params + (extra or [])

    def label(i: int) -> str:
        return f"parameter #{i}" if i < len(params) else f"layout line #{i - len(params)}"

    data = torch.tensor(list(json.dumps(entries).encode()), dtype=torch.int32)
    sizes = backend.all_gather(torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(max(int(s.item()) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.int32)
    padded[: data.numel()] = data
    gathered = backend.all_gather(padded)
    tables: list[list[str]] = [
        json.loads(bytes(g[: int(s.item())].tolist()).decode())
        for g, s in zip(gathered, sizes, strict=True)
    ]
    reference = tables[0]
    for other_rank, table in enumerate(tables[1:], start=1):
        if table == reference:
            continue
        for i in range(max(len(reference), len(table))):
            a = reference[i] if i < len(reference) else "<no parameter>"
            b = table[i] if i < len(table) else "<no parameter>"
            if a != b:
                raise ConfigError(
                    f"{what}: the ranks wrap different models; {label(i)} differs: "
                    f"rank 0 has {a!r}, rank {other_rank} has {b!r}",
                    rank=backend.rank,
                    world_size=backend.world_size,
                    peer=other_rank,
                )
