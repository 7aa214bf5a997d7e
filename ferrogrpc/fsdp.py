"""FSDP: every parameter sharded 1/world_size across ranks, all-gathered for
forward, its gradient mean-reduce-scattered after backward."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .backend import Backend, Work
from .ddp import check_same_model
from .errors import ConfigError
from .ops import SUPPORTED_DTYPES


@dataclasses.dataclass
class _Sharded:
    name: str
    param: nn.Parameter  # the module's own Parameter: empty between steps
    shard: nn.Parameter  # this rank's shard, what optimizers train
    shape: torch.Size
    numel: int
    shard_numel: int


class FSDP(nn.Module):
    """Fully sharded data parallel: each rank keeps ``1/world_size`` of every
    parameter, so parameters and optimizer state shrink with the world size.

    Construction flattens every parameter, pads it to a multiple of
    ``world_size`` with zeros and keeps this rank's contiguous shard as a new
    Parameter; the module's own Parameter objects stay registered (so names,
    hooks and ``state_dict`` keys are unchanged) but hold no data between
    steps. ``fsdp.parameters()`` yields the shards: build the optimizer on it.

    ``fsdp(x)`` all-gathers every parameter from its shards (all concurrently,
    as tagged collectives), installs the full tensors into the module's
    Parameters and runs the forward, so autograd accumulates full gradients.
    ``sync_gradients()`` mean-reduce-scatters every full gradient
    (concurrently), sets each shard's ``.grad`` and then frees the full
    parameters and gradients. A parameter without a gradient on a rank counts
    as zeros there.

    Synchronization: construction (model fingerprint check), every forward,
    ``sync_gradients()``, ``full_state_dict()``, ``state_dict()`` and
    ``into_inner()`` are collectives: every rank calls them in the same order.
    ``load_full_state_dict()`` and ``update_shards()`` are local.

    Failure: a failed collective raises the backend's error; if it was
    ``sync_gradients()``, the shards' ``.grad`` are left as they were.
    """

    def __init__(self, module: nn.Module, backend: Backend) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        check_same_model(module, backend, "FSDP")
        self.module = module
        self._backend = backend
        self._world = backend.world_size
        self._rank = backend.rank
        self._entries: list[_Sharded] = []
        self._gathered = False
        self._released = False
        for name, p in module.named_parameters():
            if p.dtype not in SUPPORTED_DTYPES:
                raise ConfigError(f"FSDP: parameter {name} has unsupported dtype {p.dtype}")
            numel = p.numel()
            shard_numel = -(-numel // self._world)
            flat = p.detach().reshape(-1)
            lo = min(self._rank * shard_numel, numel)
            hi = min(lo + shard_numel, numel)
            data = torch.zeros(shard_numel, dtype=p.dtype, device=p.device)
            data[: hi - lo] = flat[lo:hi]
            shard = nn.Parameter(data, requires_grad=p.requires_grad)
            self._entries.append(_Sharded(name, p, shard, p.shape, numel, shard_numel))
            _free(p)

    @property
    def backend(self) -> Backend:
        return self._backend

    # ----------------------------------------------------------- parameters

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The shard parameters, under the inner module's names."""
        for entry in self._entries:
            yield prefix + entry.name, entry.shard

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, shard in self.named_parameters():
            yield shard

    def shard_numels(self) -> list[int]:
        return [e.shard_numel for e in self._entries]

    def update_shards(self, flat: torch.Tensor) -> None:
        """Set every shard of this rank from one flat tensor, in parameter
        order. Local (no communication). Raises ValueError if the length is
        not the sum of the shard sizes."""
        expected = sum(e.shard_numel for e in self._entries)
        if flat.dim() != 1 or flat.numel() != expected:
            raise ConfigError(
                f"update_shards: expected a flat tensor of {expected} elements (the sum of this "
                f"rank's shard sizes), got shape {tuple(flat.shape)} ({flat.numel()} elements)",
                rank=self._rank,
                world_size=self._world,
            )
        offset = 0
        with torch.no_grad():
            for e in self._entries:
                e.shard.copy_(flat[offset : offset + e.shard_numel])
                offset += e.shard_numel

    def flat_shards(self) -> torch.Tensor:
        """This rank's shards concatenated (the inverse of update_shards)."""
        return torch.cat([e.shard.detach() for e in self._entries])

    # -------------------------------------------------------------- gather

    def _gather(self) -> list[torch.Tensor]:
        self._check_usable()
        works: list[Work[torch.Tensor]] = []
        outs: list[torch.Tensor] = []
        for e in self._entries:
            out = torch.empty(
                e.shard_numel * self._world, dtype=e.shard.dtype, device=e.shard.device
            )
            works.append(self._backend.all_gather_into_tensor(out, e.shard.detach(), async_op=True))
            outs.append(out)
        for work in works:
            work.wait()
        return [out[: e.numel].view(e.shape) for out, e in zip(outs, self._entries, strict=True)]

    def _install(self) -> None:
        for e, full in zip(self._entries, self._gather(), strict=True):
            e.param.data = full
        self._gathered = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """All-gather the full parameters, then run the module's forward."""
        self._install()
        return self.module(*args, **kwargs)

    # ---------------------------------------------------------------- sync

    def sync_gradients(self) -> None:
        """Mean-reduce-scatter every full gradient into its shard's ``.grad``,
        then free the full parameters and gradients. A collective."""
        self._check_usable()
        works: list[Work[torch.Tensor]] = []
        grads: list[torch.Tensor] = []
        for e in self._entries:
            padded = torch.zeros(
                e.shard_numel * self._world, dtype=e.shard.dtype, device=e.shard.device
            )
            g = e.param.grad if self._gathered else None
            if g is not None:
                padded[: e.numel] = g.detach().reshape(-1)
            out = torch.empty(e.shard_numel, dtype=e.shard.dtype, device=e.shard.device)
            works.append(self._backend.reduce_scatter_tensor(out, padded, "mean", async_op=True))
            grads.append(out)
            del padded
        for work in works:
            work.wait()
        for e, g in zip(self._entries, grads, strict=True):
            if e.shard.requires_grad:
                e.shard.grad = g
        self._release()

    def _release(self) -> None:
        for e in self._entries:
            e.param.grad = None
            _free(e.param)
        self._gathered = False

    # --------------------------------------------------------- checkpoints

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unpadded tensors under the inner module's keys, on every rank.
        A collective."""
        # By identity: a tied parameter appears once in named_parameters()
        # but under every alias in state_dict().
        fulls = {id(e.param): full for e, full in zip(self._entries, self._gather(), strict=True)}
        out: dict[str, torch.Tensor] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            full = fulls.get(id(value))
            out[key] = full.clone() if full is not None else value.detach().clone()
        return out

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load full tensors (as from full_state_dict) into this rank's shards
        and the module's buffers. Local."""
        self._check_usable()
        names = {e.name for e in self._entries}
        missing = [e.name for e in self._entries if e.name not in state_dict]
        if missing:
            raise ConfigError(f"load_full_state_dict: missing keys {missing}")
        with torch.no_grad():
            for e in self._entries:
                full = state_dict[e.name]
                if tuple(full.shape) != tuple(e.shape):
                    raise ConfigError(
                        f"load_full_state_dict: {e.name} has shape {tuple(full.shape)}, "
                        f"expected {tuple(e.shape)}"
                    )
                flat = full.detach().reshape(-1).to(e.shard.dtype)
                lo = min(self._rank * e.shard_numel, e.numel)
                hi = min(lo + e.shard_numel, e.numel)
                e.shard.zero_()
                e.shard[: hi - lo].copy_(flat[lo:hi])
            buffers = {k: v for k, v in state_dict.items() if k not in names}
            if buffers:
                own = dict(self.module.named_buffers())
                for key, value in buffers.items():
                    if key in own:
                        own[key].copy_(value)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Same as :meth:`full_state_dict` (a collective)."""
        return self.full_state_dict()

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Same as :meth:`load_full_state_dict` (local)."""
        self.load_full_state_dict(state_dict)

    def into_inner(self) -> nn.Module:
        """Gather the full parameters back into the module (a collective) and
        return it; the wrapper is unusable afterwards."""
        fulls = self._gather()
        with torch.no_grad():
            for e, full in zip(self._entries, fulls, strict=True):
                e.param.data = full.clone()
                e.param.grad = None
        self._released = True
        return self.module

    def _check_usable(self) -> None:
        if self._released:
            raise ConfigError("this FSDP wrapper was unwrapped with into_inner()")


def _free(p: torch.Tensor) -> None:
    """Drop a parameter's storage, keeping the Parameter object."""
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def resident_parameter_bytes(module: nn.Module, extra: list[torch.Tensor] | None = None) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters (and
    ``extra`` tensors): what parameters keep resident."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *(extra or [])]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
