"""FSDP units at run time: the hooks that all-gather a unit's parameters
just before its forward (prefetching the next unit's), free them after it,
gather them again before its backward, and mean-reduce-scatter its
gradients as soon as its backward is done."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import FerroGrpcError
from ..observe.observer import FSDP_GATHER_WAIT, FSDP_REDUCE_WAIT
from ..runtime.backend import Backend
from ..runtime.peer import observer_of
from ..runtime.work import Work
from .fsdp_plan import ShardedParam, UnitPlan


class _Unit:
    """One unit's state: its parameters, the gathers in flight for them, and
    how far its backward has got in the current backward pass."""

    def __init__(self, plan: UnitPlan, entries: list[ShardedParam]) -> None:
        self.name = plan.name or "<root>"
        self.module = plan.module
        self.entries = entries
        self.trained = [e for e in entries if e.shard.requires_grad]
        self.gathers: list[Work[torch.Tensor]] | None = None  # issued, not yet waited
        self.gathered = False  # full parameters installed
        self.ran = False  # its forward ran in the current forward pass
        self.ready: set[int] = set()  # ids of parameters whose gradient is in
        self.launched = False  # reduce-scattered in the current backward pass


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class UnitRuntime:
    """Drives the units of one FSDP wrapper (see :class:`ferrogrpc.FSDP`).

    Every collective is issued from the thread that runs forward or
    backward, in an order fixed by the model's execution: forward in
    execution order, backward in autograd's order, reduce-scatters strictly
    in reverse forward order. All ranks therefore issue the same sequence.
    """

    def __init__(
        self,
        plans: list[UnitPlan],
        by_name: dict[str, ShardedParam],
        backend: Backend,
        reshard_after_forward: bool,
        tolerate: Callable[[FerroGrpcError], None] | None = None,
    ) -> None:
        self._backend = backend
        # An elastic group's: a collective that fails in a hook voids the
        # step (ElasticShards.failed) and the hooks go on without
        # communication; None: it raises.
        self._tolerate = tolerate
        self._void = False
        self._world = backend.world_size
        self._reshard = reshard_after_forward
        self._lock = threading.RLock()
        self.units = [_Unit(plan, [by_name[n] for n in plan.names]) for plan in plans]
        self._unit_of = {id(e): u.name for u in self.units for e in u.entries}
        self._root = self.units[0]
        self._order: list[_Unit] = []  # forward execution order, from the first forward
        self._frozen = False
        self._launch_order: list[_Unit] = []
        self._next_launch = 0
        self._in_backward = False
        self._rounds = 0  # backward passes since the last sync
        self._pending: list[tuple[ShardedParam, Work[torch.Tensor], torch.Tensor]] = []
        # Where each trained gradient shard lands in one buffer per backward
        # pass (byte offsets by id of the entry, and the buffer's size), as
        # elastic FSDP hands them to a buddy in one message; None: each
        # lands in a tensor of its own.
        self.grad_offsets: dict[int, int] | None = None
        self.grad_bytes = 0
        self._arena: torch.Tensor | None = None
        self._handles: list[RemovableHandle] = []
        self.relayout(self._world)
        for unit in self.units:
            if unit is not self._root:
                pre = functools.partial(self._pre_forward, unit)
                post = functools.partial(self._post_forward, unit)
                self._handles.append(unit.module.register_forward_pre_hook(pre))
                self._handles.append(unit.module.register_forward_hook(post))
            for e in unit.trained:
                hook = functools.partial(self._on_grad, unit, e)
                self._handles.append(e.param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def relayout(self, world: int) -> None:
        """Gather buffers for shards of 1/``world`` (none gathered now)."""
        self._world = world
        for unit in self.units:
            for e in unit.entries:
                full = torch.empty(
                    e.shard_numel * world, dtype=e.shard.dtype, device=e.shard.device
                )
                full.untyped_storage().resize_(0)
                e.full = full

    def _failed(self, exc: FerroGrpcError) -> None:
        if self._tolerate is None:
            raise exc
        self._tolerate(exc)
        self._void = True

    def layout(self) -> list[tuple[str, list[str]]]:
        return [(u.name, [e.name for e in u.entries]) for u in self.units]

    # ------------------------------------------------------------ gathers

    def _issue(self, unit: _Unit) -> None:
        """Start gathering ``unit``'s full parameters, unless they are
        installed or on their way."""
        if unit.gathered or unit.gathers is not None or not unit.entries:
            return
        unit.gathers = []
        for e in unit.entries:
            assert e.full is not None
            e.full.untyped_storage().resize_(e.full.numel() * e.full.element_size())
            if self._void:
                continue  # a void step: no communication (see _failed)
            try:
                work = self._backend.all_gather_into_tensor(e.full, e.shard.detach(), async_op=True)
            except FerroGrpcError as exc:
                self._failed(exc)
                continue
            unit.gathers.append(work)

    def _ensure(self, unit: _Unit) -> None:
        """Wait for ``unit``'s gathers (starting them if need be) and install
        the full parameters. On failure the gathers stay recorded, so that
        their buffers are not freed under a collective still writing them."""
        self._issue(unit)
        if unit.gathers is None:
            return
        nbytes = sum(e.full.nbytes for e in unit.entries if e.full is not None)
        with observer_of(self._backend.peer).span(
            FSDP_GATHER_WAIT, f"gather {unit.name}", unit=unit.name, bytes=nbytes
        ):
            for work in unit.gathers:
                try:
                    work.wait()
                except FerroGrpcError as exc:
                    self._failed(exc)
        if self._void:
            for e in unit.entries:
                assert e.full is not None
                e.full.zero_()
        unit.gathers = None
        for e in unit.entries:
            assert e.full is not None
            e.param.data = e.full[: e.numel].view(e.shape)
        unit.gathered = True

    def _free(self, unit: _Unit) -> None:
        """Reshard: empty the parameters and give the gather buffers' memory
        back (after any gather still writing them has ended)."""
        if unit.gathers is not None:
            for work in unit.gathers:
                # Its failure, if any, is reported where the result is used.
                with contextlib.suppress(Exception):
                    work.wait()
            unit.gathers = None
        for e in unit.entries:
            e.param.data = torch.empty(0, dtype=e.shard.dtype, device=e.shard.device)
            assert e.full is not None
            e.full.untyped_storage().resize_(0)
        unit.gathered = False

    def free_all(self) -> None:
        with self._lock:
            for unit in self.units:
                self._free(unit)

    # ------------------------------------------------------------ forward

    def _record(self, unit: _Unit) -> None:
        unit.ran = True
        if not self._frozen and unit not in self._order:
            self._order.append(unit)

    def _prefetch_forward(self, unit: _Unit) -> None:
        if not self._frozen:
            return  # the order is known after the first forward
        at = self._order.index(unit) + 1
        if at < len(self._order) and not self._order[at].ran:
            self._issue(self._order[at])

    def begin_forward(self) -> None:
        """The root's pre-forward: drop what an earlier forward left
        gathered (the shards may have changed since), gather the root's
        parameters and prefetch the first unit's."""
        with self._lock:
            if self._in_backward:
                self._end_backward()  # a backward that stopped midway
            for unit in self.units:
                self._free(unit)
                unit.ran = False
            self._record(self._root)
            self._issue(self._root)
            self._prefetch_forward(self._root)
            self._ensure(self._root)

    def end_forward(self, output: object) -> None:
        with self._lock:
            if not self._frozen:
                self._order += [u for u in self.units if u not in self._order]
                self._launch_order = [u for u in reversed(self._order) if u.trained]
                self._frozen = True
            for unit in self.units:
                if not unit.ran:
                    self._free(unit)  # prefetched, but its forward did not run
            # The root keeps its parameters for backward, which follows.
            self._after_forward(self._root, output, reshard=False)

    def _pre_forward(self, unit: _Unit, module: nn.Module, args: Any) -> None:
        with self._lock:
            if self._in_backward:
                # Recomputed for activation checkpointing: gather, no prefetch.
                self._ensure(unit)
                return
            self._record(unit)
            self._issue(unit)
            self._prefetch_forward(unit)
            self._ensure(unit)

    def _post_forward(self, unit: _Unit, module: nn.Module, args: Any, output: Any) -> None:
        with self._lock:
            if self._in_backward:
                return  # a recompute: its backward comes next and needs them
            self._after_forward(unit, output, reshard=self._reshard)

    def _after_forward(self, unit: _Unit, output: object, reshard: bool) -> None:
        needs_grad = [t for t in _tensors(output) if t.requires_grad]
        if torch.is_grad_enabled() and needs_grad and (unit.entries or unit is self._root):
            # The pre-backward hook: a hook on the unit's outputs runs when
            # the first gradient reaches any of them, which is before autograd
            # runs any node inside the unit, so before anything reads the
            # tensors the unit saved from its parameters (views of the
            # gather buffers). A multi-grad hook in "any" mode fires once per
            # backward pass however many outputs there are. Hooks on the
            # parameters would fire too late: after the nodes that use them.
            torch.autograd.graph.register_multi_grad_hook(
                needs_grad, functools.partial(self._pre_backward, unit), mode="any"
            )
            if reshard:
                self._free(unit)
        else:
            self._free(unit)  # no backward will need them

    # ----------------------------------------------------------- backward

    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            # Runs once this backward pass is over: reduce-scatters the units
            # whose gradients did not all arrive (unused parameters), so that
            # every rank issues one reduce-scatter per unit per backward.
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._end_backward_callback)
            # Whichever hook runs first (the root's output hook is registered
            # last, so on a shared output tensor it runs last), the first
            # unit in backward order starts gathering now.
            self._prefetch_backward(None)

    def _pre_backward(self, unit: _Unit, _grad: torch.Tensor | None) -> None:
        with self._lock:
            self._enter_backward()
            if unit.launched:
                return
            self._issue(unit)
            self._prefetch_backward(unit)
            self._ensure(unit)

    def _prefetch_backward(self, unit: _Unit | None) -> None:
        """Start gathering the unit that backward reaches after ``unit``
        (the first one, for None or the root), if it needs it."""
        order = self._order[::-1]
        after = order if unit is None or unit is self._root else order[order.index(unit) + 1 :]
        for nxt in after:
            if nxt.launched or not nxt.entries:
                continue
            self._issue(nxt)
            return

    def _on_grad(self, unit: _Unit, entry: ShardedParam, param: torch.Tensor) -> None:
        with self._lock:
            self._enter_backward()
            if unit.launched:
                raise RuntimeError(
                    f"FSDP: parameter {entry.name} received a gradient after unit {unit.name} "
                    "was already reduce-scattered in this backward pass"
                )
            unit.ready.add(id(entry))
            # In reverse forward order only, so that all ranks issue the same
            # sequence whatever order gradients arrive in.
            while self._next_launch < len(self._launch_order):
                nxt = self._launch_order[self._next_launch]
                if len(nxt.ready) < len(nxt.trained):
                    break
                self._next_launch += 1
                self._launch(nxt)

    def _launch(self, unit: _Unit) -> None:
        """Mean-reduce-scatter the unit's full gradients into fresh shard
        buffers (``.grad`` is only assigned by sync), then free the full
        gradients and parameters."""
        unit.launched = True
        for e in unit.trained:
            grad = e.param.grad
            e.param.grad = None
            padded = e.shard_numel * self._world
            kw: dict[str, Any] = {"dtype": e.shard.dtype, "device": e.shard.device}
            if grad is None:
                flat = torch.zeros(padded, **kw)  # no gradient here counts as zeros
            elif padded == e.numel and grad.is_contiguous():
                flat = grad.detach().view(-1)  # no copy; the collective keeps it alive
            else:
                flat = torch.zeros(padded, **kw)
                flat[: e.numel].copy_(grad.detach().reshape(-1))
            del grad
            out = self._out(e)
            if not self._void:
                try:
                    work = self._backend.reduce_scatter_tensor(out, flat, "mean", async_op=True)
                    self._pending.append((e, work, out))
                except FerroGrpcError as exc:
                    self._failed(exc)
            del flat
        if len(unit.trained) == len(unit.entries):
            # Every use of a trained parameter is a node that computes its
            # gradient, so once all gradients are in nothing reads them again.
            # A frozen one may still be read (a LoRA base weight, for the
            # input's gradient): such a unit is freed when backward ends.
            self._free(unit)

    def _out(self, e: ShardedParam) -> torch.Tensor:
        """A fresh buffer for ``e``'s gradient shard (see grad_offsets)."""
        at = None if self.grad_offsets is None else self.grad_offsets.get(id(e))
        if at is None:
            return torch.empty(e.shard_numel, dtype=e.shard.dtype, device=e.shard.device)
        if self._arena is None:
            self._arena = torch.empty(self.grad_bytes, dtype=torch.uint8, device=e.shard.device)
        size = e.shard_numel * e.shard.element_size()
        return self._arena[at : at + size].view(e.shard.dtype)

    def _end_backward_callback(self) -> None:
        with self._lock:
            self._end_backward()

    def _end_backward(self) -> None:
        try:
            while self._next_launch < len(self._launch_order):
                self._next_launch += 1
                self._launch(self._launch_order[self._next_launch - 1])
        finally:
            for unit in self.units:
                self._free(unit)
                unit.ready.clear()
                unit.launched = False
            self._next_launch = 0
            self._in_backward = False
            self._rounds += 1
            self._arena = None  # the next pass's shards land in a new one

    # --------------------------------------------------------------- sync

    def sync(self) -> None:
        """Wait for every reduce-scatter issued since the last sync and only
        then set each shard's ``.grad`` (the sum over backward passes); on
        any failure raise the first error and leave ``.grad`` alone."""
        for e, grad in self.collect().values():
            e.shard.grad = grad

    def collect(self) -> dict[int, tuple[ShardedParam, torch.Tensor]]:
        """Wait for every reduce-scatter issued since the last sync: each
        trained entry's gradient shard (the sum over backward passes), by
        the entry's id. Raises the first failure (or a void step's)."""
        void, self._void = self._void, False
        with self._lock:
            try:
                if self._in_backward:
                    self._end_backward()  # a backward that stopped midway
                if self._rounds == 0:
                    # No backward since the last sync: reduce zeros, as a rank
                    # with a backward reduces its gradients, so that both
                    # issue the same collectives.
                    order = self._launch_order or [u for u in self.units[::-1] if u.trained]
                    for unit in order:
                        self._launch(unit)
                        unit.launched = False
            finally:
                pending, self._pending, self._rounds = self._pending, [], 0
                self._arena = None
        failure: BaseException | None = None
        for e, work, out in pending:
            owner = self._unit_of.get(id(e), "?")
            try:
                with observer_of(self._backend.peer).span(
                    FSDP_REDUCE_WAIT,
                    f"reduce-scatter {owner}",
                    unit=owner,
                    param=e.name,
                    bytes=out.nbytes * self._world,
                ):
                    work.wait()
            except BaseException as exc:  # wait for every one, then raise the first
                failure = failure or exc
        if failure is not None:
            raise failure
        if void:
            raise FerroGrpcError("a collective of this step failed (the step is void)")
        sums: dict[int, tuple[ShardedParam, torch.Tensor]] = {}
        for e, _, out in pending:
            seen = sums.get(id(e))
            sums[id(e)] = (e, out if seen is None else seen[1] + out)
        return sums

    def close(self) -> None:
        """Remove every hook and free every gathered parameter."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.free_all()
