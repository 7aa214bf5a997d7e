"""The model fingerprint check both wrappers run when they are built: the
ranks must wrap the same parameters (names, shapes, dtypes) and, where the
wrapper has one, the same layout, or every rank raises a ConfigError naming
the first difference. And the tensors' start, which both take from one
rank: :func:`broadcast_in_place`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ConfigError
from ..ops import SUPPORTED_DTYPES


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


class Broadcasts(Protocol):
    """What :func:`broadcast_in_place` needs of a Backend."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any: ...


def broadcast_in_place(backend: Broadcasts, tensors: Sequence[torch.Tensor], root: int) -> None:
    """``root``'s values of ``tensors`` on every rank, in place: one broadcast
    per dtype and device, in a fixed order (a dtype no collective carries
    travels as int64). A collective: every rank must call it with the same
    tensors."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for key in sorted(groups, key=str):
        group = groups[key]
        wire = key[0] if key[0] in SUPPORTED_DTYPES else torch.int64
        flat = torch.cat([t.detach().reshape(-1).to(wire) for t in group])
        backend.broadcast(flat, root)
        unflatten_into(flat, group)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive runs of ``flat`` into ``tensors``, in place, each
    converted to its own dtype."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view(t.shape).to(t.dtype))
            offset += n
