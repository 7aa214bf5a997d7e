"""Where a call's tensors meet the ring: the flat host buffer a job runs on.

A contiguous CPU tensor is the buffer itself (a view, no copy); a
non-contiguous one runs on a contiguous copy that is written back after. A
device tensor (CUDA) is staged through a pinned host buffer by a
:class:`~ferrogrpc.algorithms.staging.Stage`, whose copies overlap the streaming (see
staging.py). Every builder here runs on the caller's thread and returns a
:class:`Placed`: the job, and what to do once its ring has run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..algorithms.jobs import Job
from ..algorithms.staging import Copier, CudaCopier, PinnedPool, Stage, host_view
from ..errors import ConfigError, Identity

CopierFactory = Callable[[torch.Tensor], Copier]


def _nothing() -> None:
    pass


@dataclasses.dataclass
class Placed:
    """A job on its host buffer, and ``after()``: the copy back into the
    caller's tensor, to run once the job succeeded."""

    job: Job
    after: Callable[[], None] = _nothing


def _flat_host(tensor: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A flat contiguous view of a CPU tensor to run the ring on, and the
    contiguous copy (if the tensor was not contiguous) to copy back."""
    t = tensor.detach()
    if t.is_contiguous():
        return None, t.view(-1)
    copy = t.contiguous()
    return copy, copy.view(-1)


def _copier_back(tensor: torch.Tensor, copy: torch.Tensor | None) -> Callable[[], None]:
    if copy is None:
        return _nothing

    def back() -> None:
        with torch.no_grad():
            tensor.copy_(copy.view(tensor.shape))

    return back


class Placement:
    """Builds the host buffers of one rank's jobs. ``copier_factory`` and
    ``pool`` replace the CUDA copier and the pinned pool (tests stage CPU
    tensors through a deliberately lazy copier)."""

    def __init__(
        self,
        me: Identity,
        copier_factory: CopierFactory | None = None,
        pool: PinnedPool | None = None,
    ) -> None:
        self._me = me
        self._copier_factory = copier_factory
        self._pool = pool

    def staged(self, tensor: torch.Tensor) -> bool:
        if self._me.world_size == 1:
            return False
        return tensor.device.type != "cpu" or self._copier_factory is not None

    def _copier(self, tensor: torch.Tensor) -> Copier:
        if self._copier_factory is not None:
            return self._copier_factory(tensor)
        if tensor.device.type != "cuda":
            raise self._me.error(
                ConfigError, f"tensors on {tensor.device.type} are not supported; use cpu or cuda"
            )
        return CudaCopier(tensor.device)

    @property
    def pool(self) -> PinnedPool:
        if self._pool is None:
            self._pool = PinnedPool(pin=torch.cuda.is_available())
        return self._pool

    def in_place(
        self,
        tensor: torch.Tensor,
        make: Callable[[torch.Tensor], Job],
        *,
        load: bool = True,
        store: bool = True,
        prefill: Callable[[Stage, torch.Tensor], None] | None = None,
    ) -> Placed:
        """``make(flat)``'s job over ``tensor``, in place. For a staged
        tensor, ``load`` says whether the ring needs its contents, ``store``
        whether the result is written back, and ``prefill(stage, device_flat)``
        may queue copies of its own first."""
        if not self.staged(tensor):
            copy, flat = _flat_host(tensor)
            return Placed(make(flat), _copier_back(tensor, copy))
        work = tensor.detach()
        if not work.is_contiguous():
            work = work.contiguous()
        device_flat = work.view(-1)
        copier = self._copier(tensor)  # may refuse the device: before taking a seq
        raw = self.pool.acquire(work.numel() * work.element_size())
        host = host_view(raw, work.dtype, work.numel())
        job = make(host)
        stage = Stage(
            copier,
            self.pool,
            host,
            load=device_flat if load else None,
            load_at=0,
            store=device_flat if store else None,
            result=host,
            store_at=0,
            chunk_elems=job.descriptor.chunk_elems,
            release=[raw],
        )
        if prefill is not None:
            prefill(stage, device_flat)
        job.stage = stage
        if work.data_ptr() == tensor.data_ptr():
            return Placed(job)
        return Placed(job, lambda: copier.then(lambda: tensor.detach().copy_(work)))

    def reduce_scatter(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        make: Callable[[torch.Tensor, torch.Tensor], Job],
        offset: int,
        name: str,
    ) -> Placed:
        """``make(source_flat, out_flat)``'s job: reduce ``tensor``'s
        segments, writing this rank's (at element ``offset``) into ``out``.
        ``tensor`` itself is never written."""
        if not (self.staged(tensor) or self.staged(out)):
            source = tensor.detach().contiguous().reshape(-1)
            copy, flat_out = _flat_host(out)
            return Placed(make(source, flat_out), _copier_back(out, copy))
        source = tensor.detach().reshape(-1)
        if not source.is_contiguous():
            source = source.contiguous()
        work = out.detach()
        if not work.is_contiguous():
            work = work.contiguous()
        if tensor.device != out.device:
            raise self._me.error(
                ConfigError, f"tensor is on {tensor.device} but out is on {out.device}", op=name
            )
        copier = self._copier(tensor)  # may refuse the device: before taking a seq
        pool = self.pool
        raw_in = pool.acquire(source.numel() * source.element_size())
        raw_out = pool.acquire(work.numel() * work.element_size())
        host_in = host_view(raw_in, source.dtype, source.numel())
        host_out = host_view(raw_out, work.dtype, work.numel())
        job = make(host_in, host_out)
        job.stage = Stage(
            copier,
            pool,
            host_in,
            load=source,
            load_at=0,
            store=work.view(-1),
            result=host_out,
            store_at=offset,
            chunk_elems=job.descriptor.chunk_elems,
            release=[raw_in, raw_out],
        )
        if work.data_ptr() == out.data_ptr():
            return Placed(job)
        return Placed(job, lambda: copier.then(lambda: out.detach().copy_(work)))
