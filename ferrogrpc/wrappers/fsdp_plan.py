"""FSDP's pure part: a parameter's shard, and which FSDP unit owns which
parameter (no communication, testable without a group)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..errors import ConfigError

UnitPredicate = Callable[[str, nn.Module], bool]
Units = set[type[nn.Module]] | frozenset[type[nn.Module]] | UnitPredicate


@dataclasses.dataclass(eq=False)
class ShardedParam:
    """One parameter: the module's own Parameter (empty between uses) and
    this rank's padded shard, which optimizers train."""

    name: str
    param: nn.Parameter
    shard: nn.Parameter
    shape: torch.Size
    numel: int
    shard_numel: int
    # With units: the full, padded gather buffer. Its storage is resized to
    # zero bytes whenever the parameter is resharded and back before a
    # gather, so that tensors autograd saved from the parameter (views of
    # this storage) see the re-gathered values in backward.
    full: torch.Tensor | None = None

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The [lo, hi) of the unpadded flat parameter this rank's shard holds."""
        lo = min(rank * self.shard_numel, self.numel)
        return lo, min(lo + self.shard_numel, self.numel)


@dataclasses.dataclass(eq=False)
class UnitPlan:
    """A unit: a module whose forward brackets the use of ``names``."""

    name: str  # the module's qualified name; "" for the root
    module: nn.Module
    parent: UnitPlan | None
    names: list[str] = dataclasses.field(default_factory=list)

    def ancestors(self) -> list[UnitPlan]:
        chain: list[UnitPlan] = []
        node: UnitPlan | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain


def unit_matcher(units: object) -> UnitPredicate:
    """The predicate behind ``units=``: a set of module classes (matched
    with isinstance) or a ``(qualified_name, module) -> bool`` callable."""
    if isinstance(units, type):
        raise ConfigError(
            f"FSDP units: got the class {units.__name__}; pass a set of classes, "
            f"units={{{units.__name__}}}, or a predicate (name, module) -> bool"
        )
    if isinstance(units, set | frozenset | list | tuple):
        classes = tuple(units)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise ConfigError(
                f"FSDP units: every member must be an nn.Module subclass, got {bad!r}"
            )
        return lambda _name, module: isinstance(module, classes)
    if callable(units):
        predicate: UnitPredicate = units
        return lambda name, module: bool(predicate(name, module))
    raise ConfigError(
        "FSDP units must be None, a set of nn.Module classes or a predicate "
        f"(name, module) -> bool; got {type(units).__name__}"
    )


def plan_units(
    module: nn.Module, matches: UnitPredicate, named: Iterable[tuple[str, nn.Parameter]]
) -> list[UnitPlan]:
    """Partition ``named`` (the module's parameters, first names, in order)
    into units: the root first, then every submodule ``matches`` accepts,
    in module order. A parameter belongs to the innermost unit around the
    module that registers it; a parameter registered under several units
    (tied weights, a shared submodule) belongs to their innermost common
    ancestor, whose forward encloses every use. Units left without
    parameters are dropped, except the root."""
    root = UnitPlan("", module, None)
    plans: dict[int, UnitPlan] = {id(module): root}
    owners: dict[int, list[UnitPlan]] = {}

    def visit(mod: nn.Module, prefix: str, unit: UnitPlan, path: set[int]) -> None:
        for p in mod._parameters.values():
            if p is not None:
                found = owners.setdefault(id(p), [])
                if unit not in found:
                    found.append(unit)
        for child_name, child in mod._modules.items():
            if child is None or id(child) in path:
                continue
            name = f"{prefix}.{child_name}" if prefix else child_name
            inner = plans.get(id(child))
            if inner is None and matches(name, child):
                inner = plans[id(child)] = UnitPlan(name, child, unit)
            visit(child, name, inner or unit, path | {id(child)})

    visit(module, "", root, {id(module)})
    for name, p in named:
        units = owners.get(id(p), [root])
        owner = units[0]
        if len(units) > 1:
            common = set.intersection(*({id(a) for a in u.ancestors()} for u in units))
            owner = next(a for a in units[0].ancestors() if id(a) in common)
        owner.names.append(name)
    return [root] + [p for p in plans.values() if p is not root and p.names]
