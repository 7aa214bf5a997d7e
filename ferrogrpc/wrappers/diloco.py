"""DiLoCo: local training with an outer Nesterov step on the averaged
parameter change every ``sync_every`` inner steps, optionally streamed in
fragments whose exchanges overlap the next inner steps."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..elastic.backend import ElasticBackend
from ..errors import ConfigError
from ..ops import INT4, SUPPORTED_DTYPES
from ..runtime.backend import Backend
from ..runtime.work import Work
from .diloco_fragments import (
    fragment_starting,
    fragment_starts,
    make_fragment,
    parameters_in,
    sync_delay,
)
from .fingerprint import broadcast_in_place, check_same_model, unflatten_into

COMPRESSION: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int4": INT4,
}
PARAMETER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class _Exchange:
    """One fragment's outer sync, from its start to its application.

    ``average`` holds this rank's pseudo-gradient (global - local) until the
    all-reduce finishes, the mean over ranks after; ``buffers`` likewise
    this rank's floating-point buffers, then their mean (fragment 0 only).
    The ``*_at_start`` copies are what the rank held at the start, kept
    when the exchange is applied later (delay > 0)."""

    fragment: int
    started: int
    average: torch.Tensor
    local_at_start: torch.Tensor | None
    buffers: torch.Tensor | None
    buffers_at_start: torch.Tensor | None
    works: list[Work[torch.Tensor]]


class DiLoCo:
    """DiLoCo (Douillard et al., arXiv 2311.08105): each rank trains its own
    copy of the model with ``inner_optimizer`` and the ranks synchronize
    only every ``sync_every`` (H) inner steps, through an outer optimizer.

    Use::

        inner = torch.optim.AdamW(model.parameters())
        diloco = fg.DiLoCo(model, backend, inner, sync_every=500)
        for x, y in shard:
            loss_fn(diloco(x), y).backward()
            inner.step()
            inner.zero_grad()
            diloco.step()
        diloco.sync()  # every rank the same model, to evaluate or save

    Algorithm. At construction every rank takes rank 0's parameters and
    buffers (a broadcast), and keeps a *global* copy of the trainable
    parameters: float32 (float64 for float64 parameters), on the model's
    device. ``step()`` counts inner steps; after H of them, the
    pseudo-gradient ``global - local`` is averaged over ranks (one mean
    all-reduce per fragment), the outer optimizer (SGD with Nesterov
    momentum, ``outer_lr``, ``outer_momentum``; exactly
    ``torch.optim.SGD(nesterov=True)``'s update) steps the global
    parameters with it, and the local parameters are set to the new global
    ones. The inner optimizer's state is kept across syncs.

    Buffers (BatchNorm's running statistics): floating-point buffers are
    averaged over ranks with fragment 0's sync, by the same rule as its
    parameters (see the delay below); other buffers (counters) stay local.

    Streaming (``fragments=F > 1``; Douillard et al., arXiv 2501.18512):
    the trainable parameters' elements, laid end to end in registration
    order, are cut into F contiguous fragments balanced by bytes, inside a
    parameter where the balance falls there (``fragment_layout()``).
    Fragment f starts its exchange after inner step t when
    ``t % H == f * H // F`` (t >= 1), in the background
    (``async_op=True``); the inner steps go on meanwhile. It is applied
    ``tau = H // F`` inner steps later (``delay``), in the ``step()`` call
    of inner step ``t + tau``, before any exchange that call starts: that
    call waits for it if it has not arrived. The outer step uses the
    pseudo-gradient taken at step t, and the fragment's local parameters
    become ``new_global + (local_now - local_at_t)``: the local progress
    of the tau steps is replayed on top of the new global parameters, and
    is counted in the fragment's next pseudo-gradient. So at most one
    exchange is in flight at a time. With ``fragments=1``, tau is 0: the
    sync runs in ``step()`` and blocks, and local parameters become the
    new global ones.

    Compression: the pseudo-gradients travel narrowed ("bf16" over gRPC
    only: ranks that share a host exchange full precision through shared
    memory; "int8" and "int4" on every path; buffers always travel at full
    precision). Per sync and element, with W ranks
    and ``delta_r`` rank r's pseudo-gradient, the averaged one is within
    ``W * 2**-8 * mean_r |delta_r|`` of the exact mean with ``"bf16"``
    (``wire_dtype=torch.bfloat16``), within
    ``(1 + 1/508) * mean_r max|delta_r| / 127`` with ``"int8"``
    (``wire_dtype=torch.int8``, the blockwise-scaled int8 all-reduce), and
    within ``(1 + 1/28) * mean_r max|delta_r| / 7`` with ``"int4"`` (the same
    in 4 bits: half of int8's bytes), where ``max`` is over the element's
    block of 256 (no error feedback: what a sync rounds away is not carried
    to the next).
    The outer step multiplies that error by ``outer_lr`` times at most
    ``1 + outer_momentum`` in the first step (the momentum then carries it
    on, as it does the gradient).

    Synchronization: construction (a check that every rank wraps the same
    model with the same settings, then the broadcast) is a collective, and
    so is every outer sync: all ranks start and apply each fragment's
    exchange at the same inner step, so every rank must call ``step()`` the
    same number of times. ``sync()`` is a collective too (see it).
    ``state_dict()`` waits for an exchange in flight but starts no
    collective.

    Failure: a failed exchange raises the backend's error (a
    :class:`FerroGrpcError` subclass) from the ``step()`` that starts or
    applies it (or from ``state_dict()`` or ``sync()``, which wait for it). Nothing of
    that exchange is applied: the fragment's global parameters, outer
    momentum and local parameters are as they were, and the exchange is
    dropped (the step it failed in is still counted, and an exchange due
    to start in that ``step()`` is not started). The backend is then
    broken (see :class:`Backend`); ``state_dict()`` still works, to resume
    on a new backend as if the fragment had skipped that sync. Elastic
    groups (``ElasticBackend``) are not supported.

    Args:
        model: the model; every rank wraps the same one (names, shapes,
            dtypes). Its trainable parameters must be floating point and on
            one device.
        backend: this rank's :class:`Backend` (a fixed group).
        inner_optimizer: the optimizer of the model's parameters, stepped
            by the caller before each ``step()``.
        sync_every: H, the inner steps between a fragment's syncs (>= 1).
        outer_lr: the outer learning rate (> 0; 0.7 in the paper).
        outer_momentum: the outer Nesterov momentum, in [0, 1).
        fragments: F, from 1 to the number of trainable parameter elements,
            and at most ``sync_every``.
        compression: None, ``"bf16"``, ``"int8"`` or ``"int4"``: the dtype the
            pseudo-gradients cross gRPC in.

    Raises:
        ConfigError: a bad argument (on this rank, before any collective),
            or (on every rank) ranks wrapping different models or settings.
        FerroGrpcError: from construction, ``step()``, ``sync()`` and ``state_dict()``,
            what the backend raised.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: Backend,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        compression: str | None = None,
    ) -> None:
        if isinstance(backend, ElasticBackend):
            raise ConfigError(
                "DiLoCo needs the Backend of a fixed group; an ElasticBackend is not supported",
                rank=backend.rank,
                world_size=backend.world_size,
            )
        if not isinstance(backend, Backend):
            raise ConfigError(f"DiLoCo: backend must be a ferrogrpc Backend, got {backend!r}")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"DiLoCo wraps an nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise _refused(
                backend,
                "DiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                f"{type(inner_optimizer).__name__}",
            )
        if not _is_int(sync_every) or sync_every < 1:
            raise _refused(backend, f"DiLoCo: sync_every must be an int >= 1, got {sync_every!r}")
        if not _is_real(outer_lr) or not math.isfinite(outer_lr) or outer_lr <= 0:
            raise _refused(
                backend, f"DiLoCo: outer_lr must be a finite number > 0, got {outer_lr!r}"
            )
        if not _is_real(outer_momentum) or not 0 <= outer_momentum < 1:
            raise _refused(
                backend,
                f"DiLoCo: outer_momentum must be a number in [0, 1), got {outer_momentum!r}",
            )
        if not isinstance(compression, str | None) or compression not in COMPRESSION:
            raise _refused(
                backend,
                f"DiLoCo: compression must be None, 'bf16', 'int8' or 'int4', got {compression!r}",
            )
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise _refused(backend, "DiLoCo: the model has no trainable parameter")
        if not _is_int(fragments) or fragments < 1:
            raise _refused(backend, f"DiLoCo: fragments must be an int >= 1, got {fragments!r}")
        elements = sum(p.numel() for _, p in trainable)
        if fragments > elements:
            raise _refused(
                backend,
                f"DiLoCo: fragments={fragments} exceeds the model's {elements} trainable "
                "parameter elements (each fragment holds at least one)",
            )
        if fragments > sync_every:
            raise _refused(
                backend,
                f"DiLoCo: fragments={fragments} exceeds sync_every={sync_every} (each fragment "
                "starts its sync at an inner step of its own)",
            )
        _check_tensors(model, trainable, backend)
        owned = {id(p) for p in model.parameters()}
        for group in inner_optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in owned:
                    raise _refused(
                        backend,
                        "DiLoCo: inner_optimizer holds a parameter that is not the model's "
                        f"(shape {tuple(p.shape)})",
                    )

        self.module = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.fragments = fragments
        self.compression = compression
        self._backend = backend
        self._wire = COMPRESSION[compression]
        self._steps = 0
        self._pending: _Exchange | None = None
        # Per fragment, the inner step at which its local parameters were
        # last set to its global ones (-1: not since construction or load).
        self._synced_at = [-1] * fragments

        check_same_model(
            model,
            backend,
            "DiLoCo",
            extra=[
                f"sync_every={sync_every}",
                f"outer_lr={self.outer_lr!r}",
                f"outer_momentum={self.outer_momentum!r}",
                f"fragments={fragments}",
                f"compression={compression!r}",
            ],
        )
        # Rank 0's parameters and buffers everywhere, in place (the Parameter
        # objects stay, so the inner optimizer stays valid).
        broadcast_in_place(backend, [*model.parameters(), *model.buffers()], 0)
        starts = fragment_starts(
            [p.numel() for _, p in trainable], [p.element_size() for _, p in trainable], fragments
        )
        self._fragments = [
            make_fragment(trainable, lo, hi)
            for lo, hi in zip(starts, [*starts[1:], elements], strict=True)
        ]
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]

    # ------------------------------------------------------------ use

    @property
    def backend(self) -> Backend:
        """The backend whose collectives run the outer syncs."""
        return self._backend

    @property
    def inner_steps(self) -> int:
        """The inner steps counted so far (``step()`` calls, or loaded)."""
        return self._steps

    @property
    def delay(self) -> int:
        """tau: the inner steps between an exchange's start and its
        application (0 with one fragment, ``sync_every // fragments`` with
        more)."""
        return sync_delay(self.sync_every, self.fragments)

    def fragment_layout(self) -> list[list[str]]:
        """The trainable parameters, per fragment, in sync order: a name, or
        ``name[lo:hi]`` for the elements ``lo:hi`` of a parameter cut
        between two fragments (its flat elements, in its own order)."""
        return [[piece.label() for piece in f.pieces] for f in self._fragments]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""
        return self.module(*args, **kwargs)

    def step(self) -> None:
        """Count one inner step (call it after ``inner_optimizer.step()``):
        apply the exchange due at this step, if any (waiting for it), then
        start the one due, if any (with one fragment, run and apply it at
        once). A collective on the steps that start or apply one."""
        self._steps += 1
        self._apply_due()
        f = fragment_starting(self._steps, self.sync_every, self.fragments)
        if f is not None:
            # tau <= the gap between two starts: the previous one is applied.
            assert self._pending is None
            self._pending = self._start(f)
            self._apply_due()

    # ------------------------------------------------------- exchanges

    def sync(self) -> None:
        """Bring every rank to the same parameters now, as at the end of
        training (to evaluate or save the model): the exchange in flight,
        if any, is waited for and applied at once (its local progress
        replayed, as when it falls due), then every fragment syncs, blocking,
        as one fragment does at its turn: the averaged pseudo-gradient, the
        outer step, the local parameters set to the new global ones (and the
        floating-point buffers to their mean). A fragment whose local
        parameters were set to its global ones at this inner step (it
        synced here, and no inner step ran since) is left as it is: a sync
        right after a sync, or a second ``sync()``, changes nothing. No
        inner step is counted: training may go on after it, on the same
        schedule.

        Synchronizes: a collective (one mean all-reduce per fragment it
        syncs, and one for the buffers with fragment 0); every rank calls
        it after the same inner step. On failure: the backend's error is
        raised; the exchange that was in flight is applied if it had
        arrived (dropped, as in ``step()``, if it failed), and nothing of
        the fragments' own syncs is."""
        exchange = self._pending
        if exchange is not None:
            self._settle()
            self._pending = None
            self._apply(exchange)
        due = [f for f in range(self.fragments) if self._synced_at[f] != self._steps]
        started: list[_Exchange] = []
        failure: BaseException | None = None
        try:
            for f in due:
                started.append(self._start(f, keep=False))
        except BaseException as exc:
            failure = exc
        for exchange in started:  # every started one is waited for
            for work in exchange.works:
                try:
                    work.wait()
                except BaseException as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure
        for exchange in started:
            self._apply(exchange)

    def _start(self, f: int, keep: bool | None = None) -> _Exchange:
        fragment = self._fragments[f]
        local = fragment.flatten()
        if keep is None:
            keep = self.delay > 0
        local_at_start = local.clone() if keep else None
        # global - local, in place: -local + global is the same IEEE sum.
        delta = local.neg_().add_(fragment.global_params)
        works = [self._backend.all_reduce(delta, "mean", async_op=True, wire_dtype=self._wire)]
        buffers = buffers_at_start = None
        if f == 0 and self._buffers:
            buffers = _flat(self._buffers)
            buffers_at_start = buffers.clone() if keep else None
            works.append(self._backend.all_reduce(buffers, "mean", async_op=True))
        return _Exchange(f, self._steps, delta, local_at_start, buffers, buffers_at_start, works)

    def _settle(self) -> None:
        """Wait for the exchange in flight; on failure drop it and raise."""
        exchange = self._pending
        if exchange is None:
            return
        try:
            for work in exchange.works:
                work.wait()
        except BaseException:
            self._pending = None
            raise
        exchange.works = []

    def _apply_due(self) -> None:
        exchange = self._pending
        if exchange is None or exchange.started + self.delay != self._steps:
            return
        self._settle()
        self._pending = None
        self._apply(exchange)

    def _apply(self, exchange: _Exchange) -> None:
        """The outer step with an arrived exchange, and the local parameters
        (and buffers) it gives."""
        fragment = self._fragments[exchange.fragment]
        mu, lr = self.outer_momentum, self.outer_lr
        with torch.no_grad():
            # torch.optim.SGD(momentum=mu, nesterov=True, dampening=0): the
            # buffer starts at zero, so its first step is the gradient.
            grad = exchange.average
            fragment.momentum.mul_(mu).add_(grad)
            fragment.global_params.add_(grad.add(fragment.momentum, alpha=mu), alpha=-lr)
            if exchange.local_at_start is None:
                fragment.write(fragment.global_params)
            else:
                drift = fragment.flatten().sub_(exchange.local_at_start)
                fragment.write(drift.add_(fragment.global_params))
            if exchange.local_at_start is None or exchange.started == self._steps:
                # (No inner step since the start: the drift was zero.)
                self._synced_at[exchange.fragment] = self._steps
            if exchange.buffers is not None:
                averaged = exchange.buffers
                if exchange.buffers_at_start is not None:
                    averaged = _flat(self._buffers).sub_(exchange.buffers_at_start).add_(averaged)
                unflatten_into(averaged, self._buffers)

    # ----------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The inner and outer state: ``"model"`` and ``"inner_optimizer"``
        (their own state dicts, whose tensors share storage with the live
        ones, as torch's do: save or deep-copy before training on) and
        ``"outer"`` (copies: the inner step count, the global parameters
        and outer momentum per fragment, and the exchange in flight, if
        any, which this waits for). Raises the exchange's error if it
        failed (it is then dropped, as in ``step()``)."""
        self._settle()
        pending = None
        if self._pending is not None:
            ex = self._pending
            pending = {
                "fragment": ex.fragment,
                "started": ex.started,
                "average": ex.average.clone(),
                "local_at_start": _clone(ex.local_at_start),
                "buffers": _clone(ex.buffers),
                "buffers_at_start": _clone(ex.buffers_at_start),
            }
        return {
            "model": self.module.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "outer": {
                "inner_steps": self._steps,
                "sync_every": self.sync_every,
                "fragments": self.fragment_layout(),
                "global": [f.global_params.clone() for f in self._fragments],
                "momentum": [f.momentum.clone() for f in self._fragments],
                "pending": pending,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, from a DiLoCo with the same
        model, ``sync_every`` and fragments (ConfigError otherwise; the same
        number of fragments cut elsewhere, as an older ferrogrpc cut them,
        is cut again when no exchange was in flight). Local,
        no collective: every rank loads its own rank's state. An exchange
        in flight on this object is waited for and discarded."""
        backend = self._backend
        try:
            outer = state["outer"]
            model_state, optimizer_state = state["model"], state["inner_optimizer"]
            steps, pending = int(outer["inner_steps"]), outer["pending"]
            layout, sync_every = outer["fragments"], outer["sync_every"]
            global_params, momentum = list(outer["global"]), list(outer["momentum"])
        except (KeyError, TypeError) as exc:
            raise _refused(backend, f"DiLoCo: not a DiLoCo state dict: {exc!r}") from exc
        ours = self.fragment_layout()
        if (
            layout != ours
            and pending is None
            and isinstance(layout, list)
            and len(layout) == self.fragments
            and parameters_in(layout) == parameters_in(ours)
        ):
            # The same parameters and F, cut elsewhere (an older ferrogrpc
            # cut only at parameter boundaries): the outer state is
            # elementwise, so it is cut again here.
            sizes = [f.global_params.numel() for f in self._fragments]
            try:
                global_params = list(
                    torch.split(torch.cat([t.reshape(-1) for t in global_params]), sizes)
                )
                momentum = list(torch.split(torch.cat([t.reshape(-1) for t in momentum]), sizes))
            except (RuntimeError, TypeError) as exc:
                raise _refused(backend, f"DiLoCo: outer state of the wrong size: {exc}") from exc
            layout = ours
        if sync_every != self.sync_every or layout != ours:
            raise _refused(
                backend,
                f"DiLoCo: the state dict is of sync_every={sync_every} with fragments {layout}; "
                f"this one has sync_every={self.sync_every} with {ours}",
            )
        for name, tensors in (("global", global_params), ("momentum", momentum)):
            for fragment, t in zip(self._fragments, tensors, strict=True):
                if t.shape != fragment.global_params.shape:
                    raise _refused(backend, f"DiLoCo: outer {name} of the wrong size {t.shape}")
        if pending is not None and not (
            steps < pending["started"] + self.delay and pending["started"] <= steps
        ):
            raise _refused(
                backend,
                f"DiLoCo: the exchange started at step {pending['started']} is not due after "
                f"step {steps}",
            )
        try:
            self._settle()
        finally:
            self._pending = None
        self.module.load_state_dict(model_state)
        self.inner_optimizer.load_state_dict(optimizer_state)
        with torch.no_grad():
            for fragment, g, m in zip(self._fragments, global_params, momentum, strict=True):
                fragment.global_params.copy_(g)
                fragment.momentum.copy_(m)
        self._steps = steps
        self._synced_at = [-1] * self.fragments
        if pending is not None:
            fragment = self._fragments[pending["fragment"]]

            def here(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
                return None if t is None else t.to(like.device, like.dtype, copy=True)

            buffers_like = _flat(self._buffers) if self._buffers else fragment.global_params
            average = here(pending["average"], fragment.global_params)
            assert average is not None
            self._pending = _Exchange(
                fragment=int(pending["fragment"]),
                started=int(pending["started"]),
                average=average,
                local_at_start=here(pending["local_at_start"], fragment.global_params),
                buffers=here(pending["buffers"], buffers_like),
                buffers_at_start=here(pending["buffers_at_start"], buffers_like),
                works=[],
            )


# ----------------------------------------------------------------- helpers


def _refused(backend: Backend, message: str) -> ConfigError:
    return ConfigError(message, rank=backend.rank, world_size=backend.world_size)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_tensors(
    model: nn.Module, trainable: list[tuple[str, nn.Parameter]], backend: Backend
) -> None:
    for name, p in trainable:
        if p.dtype not in PARAMETER_DTYPES:
            raise _refused(
                backend,
                f"DiLoCo: trainable parameter {name} has dtype {p.dtype}; DiLoCo trains "
                "float32, float64, bfloat16 and float16 parameters",
            )
    devices = sorted({str(p.device) for _, p in trainable})
    if len(devices) > 1:
        raise _refused(
            backend,
            f"DiLoCo: the trainable parameters are on several devices {devices}; "
            "they must be on one",
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.dtype not in SUPPORTED_DTYPES:
            raise _refused(
                backend, f"DiLoCo: {name} has dtype {t.dtype}, which the backend cannot broadcast"
            )


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
