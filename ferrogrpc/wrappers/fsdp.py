"""FSDP: every parameter sharded 1/world_size across ranks, all-gathered for
forward, its gradient mean-reduce-scattered after backward; with units, one
unit (a layer) at a time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..elastic.backend import ElasticBackend
from ..errors import ConfigError, FerroGrpcError
from ..observe.observer import FSDP_GATHER_WAIT, FSDP_REDUCE_WAIT
from ..ops import SUPPORTED_DTYPES
from ..runtime.backend import Backend
from ..runtime.peer import observer_of
from ..runtime.work import Work
from .fingerprint import check_same_model
from .fsdp_elastic import ElasticShards
from .fsdp_plan import ShardedParam, Units, plan_units, unit_matcher
from .fsdp_reshard import Layout
from .fsdp_units import UnitRuntime

# The key of the metadata entry in a sharded state dict.
SHARDED_META_KEY = "_ferrogrpc_fsdp_shard"
SHARDED_FORMAT = 1


class FSDP(nn.Module):
    """Fully sharded data parallel: each rank keeps ``1/world_size`` of every
    parameter, so parameters and optimizer state shrink with the world size.

    Construction flattens every parameter, pads it to a multiple of
    ``world_size`` with zeros and keeps this rank's contiguous shard as a new
    Parameter; the module's own Parameter objects stay registered (so names,
    hooks and ``state_dict`` keys are unchanged) but hold no data between
    steps. ``fsdp.parameters()`` yields the shards: build the optimizer on it.

    ``units=None`` (one unit, the seed's plan): ``fsdp(x)`` all-gathers every
    parameter (all concurrently), installs the full tensors and runs the
    forward, so autograd accumulates full gradients; ``sync_gradients()``
    mean-reduce-scatters every full gradient, sets each shard's ``.grad`` and
    frees the full parameters and gradients. Peak memory is the whole model
    plus its full gradients.

    ``units={nn.Linear}`` (a set of module classes, matched with
    isinstance) or ``units=lambda name, module: ...`` (a predicate on the
    qualified name and the submodule): every matching submodule with
    parameters that no inner unit owns is a *unit*; the wrapped module (the
    root) holds the rest. A parameter registered under several units (tied
    weights) belongs to their innermost common ancestor, the root at worst.
    ``unit_layout()`` shows the result. Then:

    - forward: a unit's parameters are all-gathered just before its forward
      (a forward pre-hook) and, with ``reshard_after_forward=True``, freed
      right after it; the next unit's gather is issued before the current
      one computes (prefetch), in the execution order recorded in the first
      forward. The root's parameters stay gathered until its backward.
      (``reshard_after_forward`` applies to units; ``units=None`` ignores it.)
    - backward: a hook on the unit's outputs gathers its parameters again
      before autograd enters the unit, and prefetches the next unit's (in
      reverse forward order). Once every gradient of the unit is in, its
      gradients are mean-reduce-scattered at once, while backward goes on,
      and the full gradients and parameters are freed. Reduce-scatters
      start strictly in reverse forward order (a unit whose gradients are
      late holds back the later ones), and when backward ends every unit
      not yet started is (a parameter without a gradient counts as zeros).
    - ``sync_gradients()`` waits for those reduce-scatters and only then sets
      every shard's ``.grad``. Several backward passes before one sync add
      up, as with ``units=None``.

    A unit's parameters exist only during its forward and backward: code
    that reads them elsewhere (a weight used outside its module's forward)
    sees an empty tensor, and tensors computed inside a unit must reach the
    rest of the model through the unit's outputs. A unit with frozen
    parameters keeps them gathered until backward ends.

    Synchronization: construction (a fingerprint of the parameters and the
    units: a ConfigError on every rank if they differ), every forward and
    backward (units gather and reduce-scatter from hooks, in an order fixed
    by the model's execution, so every rank must run the same units in the
    same order), ``sync_gradients()``, ``full_state_dict()``,
    ``state_dict()`` and ``into_inner()`` are collectives: every rank calls
    them in the same order. ``load_full_state_dict()``, ``update_shards()``,
    ``sharded_state_dict()`` and ``load_sharded_state_dict()`` are local.

    Failure: a failed collective raises the backend's error, from the
    forward, from ``backward()`` (a gather waited for in a hook) or from
    ``sync_gradients()``. Gradients are reduced into fresh buffers and the
    shards' ``.grad`` are assigned only after every reduce-scatter since the
    last sync succeeded, so after a failure anywhere in the step every
    ``.grad`` is exactly as it was. The backend is then broken (see
    :class:`Backend`).

    Args:
        module: the model; every rank wraps the same one, starting from the
            same weights (a seed, or a broadcast before wrapping).
        backend: this rank's :class:`Backend`.
        units: None (one unit), a set of module classes, or a predicate on
            ``(qualified name, submodule)``: which submodules are units.
        reshard_after_forward: free a unit's gathered parameters after its
            forward (default), or keep them until its backward.

    Raises:
        ConfigError: a bad argument, an unsupported parameter dtype, or (on
            every rank) ranks wrapping different models or units.
        TypeError: ``module`` is not an ``nn.Module``.
        FerroGrpcError: from forward, backward, ``sync_gradients()`` and the
            collective state-dict calls, what the backend raised (see
            :class:`Backend`).
    """

    def __init__(
        self,
        module: nn.Module,
        backend: Backend,
        units: Units | None = None,
        reshard_after_forward: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        elastic = backend if isinstance(backend, ElasticBackend) else None
        joining = elastic is not None and elastic.joining
        if not isinstance(reshard_after_forward, bool):
            raise ConfigError(
                f"reshard_after_forward must be True or False, got {reshard_after_forward!r}"
            )
        named = list(module.named_parameters())
        for name, p in named:
            if p.dtype not in SUPPORTED_DTYPES:
                raise ConfigError(f"FSDP: parameter {name} has unsupported dtype {p.dtype}")
        plans = None if units is None else plan_units(module, unit_matcher(units), named)
        layout = None
        if plans is not None:
            layout = [f"unit {p.name or '<root>'}: {', '.join(p.names)}" for p in plans]
            layout.append(f"reshard_after_forward={reshard_after_forward}")
        if not joining:
            check_same_model(module, backend, "FSDP", extra=layout)
        if elastic is not None and not joining:
            # The first epoch's members start from rank 0's weights, as
            # elastic DDP's do (ElasticState's start).
            with torch.no_grad():
                for _, p in named:
                    backend.broadcast(p.data, 0)
        self.module = module
        self._backend = backend
        # A joiner holds no shard until the epoch that admits it lays them out.
        self._world = backend.world_size if not joining else 1
        self._rank = backend.rank if not joining else 0
        self._entries: list[ShardedParam] = []
        self._gathered = False
        self._released = False
        # In an elastic group: the shard whose copy this rank keeps, cut as
        # its own are ([Note: shards held twice]).
        copies: list[torch.Tensor] = []
        owner: int | None = None
        if elastic is not None and not joining:
            m = elastic.membership
            owner = Layout(m.epoch, m.world_size, m.hosts).copy_of(self._rank)
        for name, p in named:
            numel = p.numel()
            shard_numel = -(-numel // self._world) if not joining else 0
            flat = p.detach().reshape(-1)
            lo = min(self._rank * shard_numel, numel)
            hi = min(lo + shard_numel, numel)
            data = torch.zeros(shard_numel, dtype=p.dtype, device=p.device)
            data[: hi - lo] = flat[lo:hi]
            shard = nn.Parameter(data, requires_grad=p.requires_grad)
            self._entries.append(ShardedParam(name, p, shard, p.shape, numel, shard_numel))
            if elastic is not None:
                copy = torch.zeros(shard_numel, dtype=p.dtype, device=p.device)
                if owner is not None:
                    lo = min(owner * shard_numel, numel)
                    hi = min(lo + shard_numel, numel)
                    copy[: hi - lo] = flat[lo:hi]
                copies.append(copy)
            _free(p)
        # The re-shard at every change of epoch.
        self._elastic: ElasticShards | None = None
        if elastic is not None:
            self._elastic = ElasticShards(self._entries, elastic, self._relayout, copies)
        tolerate = self._elastic.failed if self._elastic is not None else None
        self._units: UnitRuntime | None = None
        if plans is not None:
            by_name = {e.name: e for e in self._entries}
            self._units = UnitRuntime(plans, by_name, backend, reshard_after_forward, tolerate)
            self._lay_grads()

    @property
    def backend(self) -> Backend:
        """The backend whose collectives gather and reduce-scatter."""
        return self._backend

    # ----------------------------------------------------------- parameters

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The shard parameters, under the inner module's names."""
        for entry in self._entries:
            yield prefix + entry.name, entry.shard

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's shard parameters (what the optimizer steps)."""
        for _, shard in self.named_parameters():
            yield shard

    def shard_numels(self) -> list[int]:
        """Each shard's element count on this rank, in parameter order."""
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

    def _gather(self, tolerant: bool = False) -> list[torch.Tensor]:
        """Every full parameter. ``tolerant`` (an elastic group's forward): a
        failed gather voids the step instead of raising, and the forward
        goes on with zeros (see ElasticShards.failed)."""
        self._check_usable()
        outs = [
            torch.zeros(e.shard_numel * self._world, dtype=e.shard.dtype, device=e.shard.device)
            for e in self._entries
        ]
        elastic = self._elastic if tolerant else None
        if elastic is None or elastic.void is None:
            try:
                works = [
                    self._backend.all_gather_into_tensor(out, e.shard.detach(), async_op=True)
                    for out, e in zip(outs, self._entries, strict=True)
                ]
                nbytes = sum(out.nbytes for out in outs)
                observer = observer_of(self._backend.peer)
                with observer.span(FSDP_GATHER_WAIT, "gather <root>", unit="<root>", bytes=nbytes):
                    for work in works:
                        work.wait()
            except FerroGrpcError as exc:
                if elastic is None:
                    raise
                elastic.failed(exc)
                for out in outs:
                    out.zero_()
        return [out[: e.numel].view(e.shape) for out, e in zip(outs, self._entries, strict=True)]

    def _relayout(self, world: int, rank: int) -> None:
        """An elastic group's new layout took effect: every shard is now
        1/``world`` of its parameter (the same Parameter objects)."""
        self._world, self._rank = world, rank
        for e in self._entries:
            e.shard_numel = -(-e.numel // world)
        if self._units is not None:
            self._units.relayout(world)
            self._lay_grads()

    def _lay_grads(self) -> None:
        # Elastic: the gradient shards land where the hand-over sends them.
        if self._elastic is not None and self._units is not None:
            self._units.grad_offsets, self._units.grad_bytes = self._elastic.grad_layout()

    def _install(self) -> None:
        for e, full in zip(self._entries, self._gather(tolerant=True), strict=True):
            e.param.data = full
        self._gathered = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward with its parameters gathered: all of them
        first (``units=None``), or unit by unit (see the class docstring)."""
        if self._units is None:
            self._install()
            return self.module(*args, **kwargs)
        self._check_usable()
        self._units.begin_forward()
        output = self.module(*args, **kwargs)
        self._units.end_forward(output)
        return output

    def unit_layout(self) -> list[tuple[str, list[str]]]:
        """The units, root first (named ``"<root>"``), each with the names of
        the parameters it owns; ``units=None`` is the root owning them all."""
        if self._units is None:
            return [("<root>", [e.name for e in self._entries])]
        return self._units.layout()

    # ---------------------------------------------------------------- sync

    def sync_gradients(self) -> None:
        """Set every shard's ``.grad`` to the mean over ranks of its gradient.
        A collective: every rank calls it after backward, before the
        optimizer step.

        ``units=None``: mean-reduce-scatters every full gradient, then frees
        the full parameters and gradients. With units: waits for the
        reduce-scatters that backward started (reducing zeros if there was
        no backward since the last sync). Either way ``.grad`` is assigned
        only once every reduce-scatter succeeded; on failure this raises and
        leaves every ``.grad`` as it was.

        In an elastic group a failure does not raise: the step is void, the
        group forms again without the lost (re-sharded in memory, see
        [Note: shards held twice]), every ``.grad`` is None and
        ``ElasticState.steps()`` yields this step again, to be re-run over
        the new group."""
        self._check_usable()
        if self._elastic is not None:
            self._elastic.sync(self._reduce)
            return
        if self._units is not None:
            self._units.sync()
            return
        for i, g in self._reduce().items():
            self._entries[i].shard.grad = g

    def _reduce(self) -> dict[int, torch.Tensor]:
        """The step's reduce-scatters, waited for (with units: started by
        backward) or run now: each trained parameter's mean gradient shard,
        by its index. Raises the first failure; nothing is assigned."""
        if self._units is not None:
            index = {id(e): i for i, e in enumerate(self._entries)}
            return {index[key]: g for key, (_, g) in self._units.collect().items()}
        works: list[Work[torch.Tensor]] = []
        grads: list[torch.Tensor] = []
        try:
            for e in self._entries:
                padded = torch.zeros(
                    e.shard_numel * self._world, dtype=e.shard.dtype, device=e.shard.device
                )
                g = e.param.grad if self._gathered else None
                if g is not None:
                    padded[: e.numel] = g.detach().reshape(-1)
                out = torch.empty(e.shard_numel, dtype=e.shard.dtype, device=e.shard.device)
                works.append(
                    self._backend.reduce_scatter_tensor(out, padded, "mean", async_op=True)
                )
                grads.append(out)
                del padded
            nbytes = sum(g.nbytes for g in grads) * self._world
            observer = observer_of(self._backend.peer)
            with observer.span(
                FSDP_REDUCE_WAIT, "reduce-scatter <root>", unit="<root>", bytes=nbytes
            ):
                for work in works:
                    work.wait()
        finally:
            self._release()
        return {
            i: g
            for i, (e, g) in enumerate(zip(self._entries, grads, strict=True))
            if e.shard.requires_grad
        }

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

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint, under the inner module's keys:
        each parameter's padded shard (detached, sharing storage with the
        shard), the buffers, and under ``"_ferrogrpc_fsdp_shard"`` the
        metadata ``load_sharded_state_dict`` checks (format, rank, world
        size, each parameter's shape and shard size). Every rank saves its
        own, e.g. ``torch.save(sd, f"ckpt.{rank}.pt")``. Local: no
        communication, and nothing full-size is built."""
        self._check_usable()
        by_id = {id(e.param): e for e in self._entries}
        out: dict[str, Any] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            entry = by_id.get(id(value))
            if entry is None:
                out[key] = value.detach() if isinstance(value, torch.Tensor) else value
            elif key == entry.name:  # a tied alias is saved once, under its first name
                out[key] = entry.shard.detach()
        out[SHARDED_META_KEY] = {
            "format": SHARDED_FORMAT,
            "rank": self._rank,
            "world_size": self._world,
            "params": {
                e.name: {"shape": list(e.shape), "shard_numel": e.shard_numel}
                for e in self._entries
            },
        }
        return out

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what ``sharded_state_dict()`` saved on this rank, at the same
        world size: the shards and the buffers. Checks everything first and
        raises ConfigError (changing nothing) if the checkpoint was saved by
        another rank or at another world size (load a ``full_state_dict()``
        to change the world size), or if a parameter is missing or has
        another shape. Local."""
        self._check_usable()
        meta = state_dict.get(SHARDED_META_KEY)

        def refuse(message: str) -> ConfigError:
            return ConfigError(
                f"load_sharded_state_dict: {message}", rank=self._rank, world_size=self._world
            )

        if not isinstance(meta, Mapping) or meta.get("format") != SHARDED_FORMAT:
            raise refuse(
                f"no {SHARDED_META_KEY!r} metadata of format {SHARDED_FORMAT}: not a sharded "
                "state dict (use load_full_state_dict for a full one)"
            )
        if meta.get("world_size") != self._world:
            raise refuse(
                f"the checkpoint was saved at world size {meta.get('world_size')}, this group has "
                f"world size {self._world}; shards reload only at the world size that saved "
                "them (save a full_state_dict() to change the world size)"
            )
        if meta.get("rank") != self._rank:
            raise refuse(
                f"the checkpoint holds rank {meta.get('rank')}'s shards; rank {self._rank} must "
                "load the one it saved"
            )
        saved = meta.get("params", {})
        for e in self._entries:
            info = saved.get(e.name)
            shard = state_dict.get(e.name)
            if info is None or not isinstance(shard, torch.Tensor):
                raise refuse(f"missing parameter {e.name}")
            if list(info["shape"]) != list(e.shape) or tuple(shard.shape) != (e.shard_numel,):
                raise refuse(
                    f"{e.name} was saved with shape {tuple(info['shape'])} (shard of "
                    f"{tuple(shard.shape)}), this model has {tuple(e.shape)} (shard of "
                    f"{e.shard_numel})"
                )
        names = {e.name for e in self._entries}
        own = dict(self.module.named_buffers())
        with torch.no_grad():
            for e in self._entries:
                e.shard.copy_(state_dict[e.name])
            for key, value in state_dict.items():
                if key not in names and key in own and isinstance(value, torch.Tensor):
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
        if self._units is not None:
            self._units.close()
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
