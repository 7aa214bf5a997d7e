"""DDP: data-parallel training with bucketed gradient all-reduce that overlaps
backward."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from ..algorithms.quantized import ErrorFeedback
from ..elastic.backend import ElasticBackend
from ..errors import ConfigError, FerroGrpcError
from ..observe.observer import DDP_BUCKET, DDP_BUCKET_WAIT, Observer
from ..ops import SUPPORTED_DTYPES
from ..runtime.allocator import keep_warm
from ..runtime.backend import Backend
from ..runtime.peer import observer_of
from ..runtime.work import Work
from .fingerprint import broadcast_in_place, check_same_model

DEFAULT_BUCKET_BYTES = 25 * 2**20
COMPRESSION: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
}


@dataclasses.dataclass
class _Bucket:
    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device
    # Two flat buffers, used in turn: after a sync every averaged ``.grad``
    # is a view of the one just reduced, and the next step fills the other,
    # so a failed all-reduce never touches the ``.grad`` tensors.
    buffers: list[torch.Tensor | None] = dataclasses.field(default_factory=lambda: [None, None])
    fill: int = 0
    pending: int = 0
    launched: bool = False
    work: Work[torch.Tensor] | None = None
    # compression="int8": the rounding errors this bucket carries into its
    # next sync (error feedback); the flags travel unrounded.
    feedback: ErrorFeedback | None = None
    # Traced: when its all-reduce was launched (wall clock), and a future of
    # when it finished (perf_counter), for the "DDP buckets" span.
    launched_at: float = 0.0
    done_at: concurrent.futures.Future[float] | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        return self.buffers[self.fill]

    def flags(self) -> torch.Tensor:
        assert self.buffer is not None
        return self.buffer[self.numel :]


class DDP(nn.Module):
    """Distributed data parallel: every rank holds the whole model, trains on
    its slice of the batch, and ``sync_gradients()`` leaves every rank's
    ``.grad`` equal to the mean over ranks.

    Gradients are all-reduced in *buckets*: flat buffers of one dtype and
    device, filled with parameters in reverse registration order (backward
    produces gradients roughly in that order), each up to
    ``bucket_size_bytes``; a larger parameter gets a bucket of its own.

    With ``overlap=True``, a hook on each parameter's gradient accumulation
    copies the gradient into its bucket, and a bucket's mean all-reduce starts
    on the backend as soon as its last gradient is in, while backward goes on.
    Buckets start strictly in bucket order, so every rank issues the same
    collectives in the same order. ``sync_gradients()`` then starts what is
    left and waits. With ``overlap=False``, ``sync_gradients()`` all-reduces
    the buckets one after another after backward.

    Gradients as bucket views: after a sync, each averaged ``.grad`` is a
    view of its slice of the bucket, not a copy (like torch DDP's
    ``gradient_as_bucket_view=True``). Each bucket has two buffers used in
    turn, so the next step's all-reduce never writes the ``.grad`` tensors
    the optimizer just read; a reference to a ``.grad`` kept across steps
    goes stale once its buffer is refilled two steps later.

    Memory, process-wide: with ferrogrpc's allocator tuning on (the
    default with ``init_backend``), a DDP of CPU parameters raises glibc's
    mmap threshold above its largest gradient (at most 256 MiB), so that
    the gradients backward allocates afresh every step are reused from the
    heap instead of being faulted in page by page; up to one such gradient
    stays in the heap between steps (README, ``FERROGRPC_MALLOC_TUNING``).

    Synchronization: construction (a model fingerprint check, ConfigError on
    every rank if the models differ), every ``sync_gradients()`` /
    ``overlapped_sync_gradients()`` and ``broadcast_parameters()`` are
    collectives: all ranks must call them in the same order.

    Unused parameters: a parameter without a gradient on some rank counts as
    zeros there, so the result is the sum over ranks divided by world_size,
    and every rank gets the same ``.grad``. A parameter that no rank used in
    the step keeps the ``.grad`` it had (``None`` after ``zero_grad()``), on
    every rank, so optimizers skip it exactly as in single-process training.

    Compression: ``compression="bf16"`` (or ``"fp16"``) sends float32 and
    float64 gradient buckets over gRPC in that dtype, halving the bytes on
    the wire; every hop still accumulates in the bucket's own dtype, and the
    averaged gradients are the same on every rank, within the error bound
    the README gives for ``wire_dtype``. Ranks sharing a host exchange full
    precision through shared memory.

    ``compression="int8"`` sends float32 and float64 buckets as
    blockwise-scaled int8, a quarter of float32's bytes, on every path (see
    [Note: int8 all-reduce] in algorithms/quantized.py): each rank's
    gradients are rounded once, and each shard's mean once more, never a
    partial sum; the mean is accumulated in the bucket's dtype and is the
    same on every rank. Error feedback: what a bucket's rounding lost on
    this rank is added to that bucket's next sync, so no gradient is lost
    over the steps. The carried error is per rank and starts again from
    zero when the world size changes (an elastic group's new epoch). It is
    always finite: a gradient's Inf or NaN comes back in the elements where
    float32's would (see [Note: non-finite values]) and is not carried, so a
    loop that skips the steps whose gradients are not finite (as AMP's loss
    scaler does) gets finite gradients again at the next step.

    Failure: if an all-reduce fails, ``sync_gradients()`` raises the
    backend's error and every ``.grad`` is left exactly as it was before the
    call (results are written back only after every bucket succeeded); the
    backend is then broken (see :class:`Backend`). In an elastic group
    (``init_backend(elastic=True)``) a lost member does not raise: the sync
    is redone with the survivors and returns their mean, and a process that
    was removed (it stalled) and joined again returns with every ``.grad``
    None and the group's state loaded (see ``fg.ElasticState``); below
    ``min_world_size`` it raises ``QuorumLostError``.

    Args:
        module: the model; every rank wraps the same one (names, shapes,
            dtypes), starting from the same weights (a seed, or
            ``broadcast_parameters()``).
        backend: this rank's :class:`Backend`.
        bucket_size_bytes: the most bytes of gradients one bucket holds
            (default 25 MiB).
        overlap: start each bucket's all-reduce during backward (default).
        compression: None, ``"bf16"``, ``"fp16"`` or ``"int8"``: the dtype
            gradient buckets cross the wire in.

    Raises:
        ConfigError: a bad argument, or (on every rank) ranks wrapping
            different models.
        TypeError: ``module`` is not an ``nn.Module``.
        FerroGrpcError: from ``sync_gradients()`` and ``broadcast_parameters()``,
            what the backend raised (see :class:`Backend`).
    """

    def __init__(
        self,
        module: nn.Module,
        backend: Backend | ElasticBackend,
        bucket_size_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        compression: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DDP wraps an nn.Module, got {type(module).__name__}")
        if compression not in COMPRESSION:
            raise ConfigError(
                f"compression must be None, 'bf16', 'fp16' or 'int8', got {compression!r}",
                rank=backend.rank,
                world_size=backend.world_size,
            )
        if not isinstance(bucket_size_bytes, int) or bucket_size_bytes < 1:
            raise ConfigError(
                f"bucket_size_bytes must be a positive int, got {bucket_size_bytes!r}"
            )
        self.module = module
        self._backend = backend
        self.bucket_size_bytes = bucket_size_bytes
        self.overlap = overlap
        self.compression = compression
        self._wire = COMPRESSION[compression]
        self._lock = threading.Lock()
        self._sync_enabled = True
        self._hooks: list[Any] = []
        if not isinstance(backend, ElasticBackend):
            # (An elastic group's members start from rank 0's weights, and
            # joiners receive them: ElasticState.)
            check_same_model(module, backend, "DDP")
        self._buckets = self._build_buckets()
        # Backward allocates every gradient afresh, at the same sizes each
        # step: keep the largest warm in the heap (see [Note: the mmap
        # threshold trades memory for page faults] in runtime/allocator.py).
        on_cpu = [p for b in self._buckets if b.device.type == "cpu" for p in b.params]
        if on_cpu:
            keep_warm(max(p.numel() * p.element_size() for p in on_cpu))
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                self._slot[id(p)] = (bucket, i)
        self._ready: set[int] = set()
        self._next_launch = 0
        self._last_work: Work[torch.Tensor] | None = None
        if overlap:
            for bucket in self._buckets:
                for p in bucket.params:
                    self._hooks.append(
                        p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                    )

    @classmethod
    def with_bucket_size(
        cls,
        module: nn.Module,
        backend: Backend | ElasticBackend,
        bucket_size_bytes: int,
        overlap: bool = True,
    ) -> DDP:
        """Wrap ``module`` with a custom bucket size in bytes."""
        return cls(module, backend, bucket_size_bytes=bucket_size_bytes, overlap=overlap)

    @property
    def backend(self) -> Backend | ElasticBackend:
        """The backend whose collectives sync the gradients."""
        return self._backend

    # -------------------------------------------------------------- buckets

    def _build_buckets(self) -> list[_Bucket]:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        for name, p in named:
            if p.dtype not in SUPPORTED_DTYPES:
                raise ConfigError(f"DDP: parameter {name} has unsupported dtype {p.dtype}")
        buckets: list[_Bucket] = []
        open_buckets: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        limit = self.bucket_size_bytes

        def overflows(bucket: _Bucket | None, nbytes: int) -> bool:
            return bucket is not None and bucket.numel * bucket.dtype.itemsize + nbytes > limit

        def place(name: str, p: nn.Parameter) -> None:
            key = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            bucket = open_buckets.get(key)
            if overflows(bucket, nbytes):
                bucket = None
            if bucket is None:
                bucket = _Bucket(len(buckets), [], [], [], 0, p.dtype, p.device)
                buckets.append(bucket)
                open_buckets[key] = bucket
            bucket.names.append(name)
            bucket.params.append(p)
            bucket.offsets.append(bucket.numel)
            bucket.numel += p.numel()
            if nbytes >= limit:
                del open_buckets[key]

        # A module's own parameters get their gradients together (one
        # backward node makes a Linear's weight and bias gradients), so they
        # are placed as a unit: a unit that does not fit the open bucket
        # starts a new one, rather than holding that bucket back until the
        # unit's layer is done; and a unit larger than a bucket closes its
        # last bucket, so the next layer's gradients do not wait on it.
        units: list[list[tuple[str, nn.Parameter]]] = []
        for name, p in reversed(named):
            owner = name.rpartition(".")[0]
            if units and units[-1][0][0].rpartition(".")[0] == owner:
                units[-1].append((name, p))
            else:
                units.append([(name, p)])
        for unit in units:
            sizes: dict[tuple[torch.dtype, torch.device], int] = {}
            for _, p in unit:
                key = (p.dtype, p.device)
                sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
            for key, total in sizes.items():
                if overflows(open_buckets.get(key), total):
                    del open_buckets[key]
            for name, p in unit:
                place(name, p)
            for key, total in sizes.items():
                if total > limit:
                    open_buckets.pop(key, None)
        for bucket in buckets:
            bucket.pending = len(bucket.params)
        return buckets

    def bucket_layout(self) -> list[list[str]]:
        """The parameter names of each bucket, in all-reduce order."""
        return [list(b.names) for b in self._buckets]

    def _buffer(self, bucket: _Bucket) -> torch.Tensor:
        buf = bucket.buffer
        if buf is None:
            # Gradients, then one "had a gradient here" flag per parameter:
            # the flags ride along in the same all-reduce.
            buf = torch.zeros(
                bucket.numel + len(bucket.params), dtype=bucket.dtype, device=bucket.device
            )
            bucket.buffers[bucket.fill] = buf
        return buf

    def _fill(self, bucket: _Bucket, i: int, p: nn.Parameter) -> None:
        buf = self._buffer(bucket)
        lo = bucket.offsets[i]
        view = buf[lo : lo + p.numel()]
        grad = p.grad
        if grad is None:
            view.zero_()
            buf[bucket.numel + i] = 0
            return
        if grad.data_ptr() == view.data_ptr() and grad.numel():
            # Still the view of this buffer from two syncs ago (no rank had a
            # gradient for it in the last one): give it its own storage, so
            # that the all-reduce cannot touch it if it fails.
            p.grad = grad = grad.clone()
        else:
            view.copy_(grad.detach().reshape(-1))
        buf[bucket.numel + i] = 1

    def _launch(self, bucket: _Bucket, *, chain: bool) -> None:
        bucket.launched = True
        buf = self._buffer(bucket)
        wire = self._wire if buf.dtype in (torch.float32, torch.float64) else None
        feedback = None
        if wire == torch.int8:
            if bucket.feedback is None:
                bucket.feedback = ErrorFeedback(exact=len(bucket.params))
            feedback = bucket.feedback
        # Chained: one bucket at a time, each starting when the previous is done.
        # (int8 buckets are not chained: each has CPU phases, rounding and
        # summing, during which another bucket's bytes can use the link.)
        after = self._last_work if chain and feedback is None else None
        launched_at = time.time()
        try:
            bucket.work = self._backend.all_reduce(
                buf, "mean", async_op=True, after=after, wire_dtype=wire, feedback=feedback
            )
        except FerroGrpcError as exc:
            bucket.done_at = None
            # The backend broke (a peer failed) while backward still runs:
            # raising here, from an autograd hook, would abort backward
            # halfway through accumulating .grad. The error is
            # sync_gradients()'s to raise, with every .grad as it was.
            failed: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            failed.set_exception(exc)
            bucket.work = Work(failed, "all_reduce")
        else:
            observer = self._observer()
            if observer is not None and observer.span_sinks:
                bucket.launched_at = launched_at
                bucket.done_at = bucket.work.when_done()
        self._last_work = bucket.work

    def _observer(self) -> Observer | None:
        """The current peer's observer (an elastic backend's changes with the
        epoch); None for an elastic process in no group yet."""
        try:
            return observer_of(self._backend.peer)
        except FerroGrpcError:
            return None

    def _wait(self, bucket: _Bucket, observer: Observer | None) -> None:
        """Wait for ``bucket``'s all-reduce: a "DDP waits" span when traced,
        and the bucket's own span, launch to done."""
        work = bucket.work
        assert work is not None
        if observer is None:
            work.wait()
            return
        nbytes = self._buffer(bucket).nbytes
        with observer.span(
            DDP_BUCKET_WAIT, f"wait for bucket {bucket.index}", bucket=bucket.index, bytes=nbytes
        ):
            work.wait()
        stamp, bucket.done_at = bucket.done_at, None
        if stamp is not None and observer.span_sinks:
            # when_done's perf_counter stamp, as a wall-clock time.
            done = time.time() - (time.perf_counter() - stamp.result())
            observer.record(
                DDP_BUCKET,
                f"bucket {bucket.index}",
                bucket.launched_at,
                done,
                bucket=bucket.index,
                bytes=nbytes,
                params=len(bucket.params),
            )

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync_enabled:
            return
        with self._lock:
            bucket, i = self._slot[id(p)]
            if bucket.launched:
                raise RuntimeError(
                    f"DDP: parameter {bucket.names[i]} received a gradient after its bucket was "
                    "already sent in this step; call sync_gradients() after each backward, or "
                    "accumulate under no_sync()"
                )
            self._fill(bucket, i, p)  # type: ignore[arg-type]
            if id(p) in self._ready:
                return  # a second backward before sync: the copy above refreshed it
            self._ready.add(id(p))
            bucket.pending -= 1
            # Launch in bucket order only, so all ranks issue the same sequence.
            while self._next_launch < len(self._buckets):
                nxt = self._buckets[self._next_launch]
                if nxt.pending > 0:
                    break
                self._launch(nxt, chain=True)
                self._next_launch += 1

    # ---------------------------------------------------------------- sync

    def _finish(self, mode: Literal["in_turn", "chained", "concurrent"]) -> None:
        """Reduce every bucket (see :meth:`_reduce`) and write the results;
        in an elastic group, redo the reduction in the next epoch if members
        are lost, and write only a sync every member committed."""
        backend = self._backend
        if not isinstance(backend, ElasticBackend):
            self._reduce(mode)
            self._write()
            return

        def attempt() -> Callable[[], None]:
            # A redo refills every bucket from .grad (the failed reduction
            # changed the buffers, never .grad) and runs it in the new epoch.
            self._reduce(mode)
            return self._write

        if backend.run_sync(attempt):
            # This process was removed and joined again: it holds the
            # group's state now, and this step is discarded.
            self._reset()
            for bucket in self._buckets:
                for p in bucket.params:
                    p.grad = None

    def _reduce(self, mode: Literal["in_turn", "chained", "concurrent"]) -> None:
        """Start the buckets not yet started and wait for all: ``in_turn``
        waits for each before starting the next, ``chained`` queues each
        behind the previous (as the overlap hooks do), ``concurrent`` starts
        them all at once."""
        observer = self._observer()
        waited: set[int] = set()
        with self._lock:
            for bucket in self._buckets:
                if not bucket.launched:
                    for i, p in enumerate(bucket.params):
                        if id(p) not in self._ready:
                            self._fill(bucket, i, p)
                    self._launch(bucket, chain=mode == "chained")
                    if mode == "in_turn":
                        self._wait(bucket, observer)
                        waited.add(bucket.index)
        try:
            for bucket in self._buckets:
                if bucket.index not in waited:
                    self._wait(bucket, observer)
        finally:
            self._reset()

    def _write(self) -> None:
        """Every bucket succeeded: only now touch .grad, which becomes a view
        of the reduced buffer (no copy); the next step fills the other one."""
        for bucket in self._buckets:
            buf = self._buffer(bucket)
            flags = bucket.flags().tolist()
            for i, p in enumerate(bucket.params):
                if flags[i] <= 0:
                    continue  # no rank had a gradient: leave .grad alone
                lo = bucket.offsets[i]
                p.grad = buf[lo : lo + p.numel()].view(p.shape)
            bucket.fill ^= 1

    def _reset(self) -> None:
        self._ready.clear()
        self._next_launch = 0
        self._last_work = None
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
            bucket.work = None

    def sync_gradients(self) -> None:
        """Average gradients over ranks; call after backward, before the
        optimizer step. A collective: every rank must call it.

        With overlap on, this waits for the buckets already started during
        backward and starts the rest; with overlap off, it all-reduces the
        buckets one after another. Either way one bucket is on the wire at a
        time, in bucket order (with ``compression="int8"``, buckets start in
        bucket order and may overlap). On failure it raises and leaves every
        ``.grad`` as it was.
        """
        self._finish("chained" if self.overlap else "in_turn")

    def overlapped_sync_gradients(self) -> None:
        """Like :meth:`sync_gradients`, but starts every remaining bucket at
        once and then waits for all of them."""
        self._finish("concurrent")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside the block
        start no communication. Call ``sync_gradients()`` after the first
        backward outside it, which averages the accumulated gradients."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # ------------------------------------------------------------ parameters

    def broadcast_parameters(self, root: int = 0) -> None:
        """Copy ``root``'s parameters and buffers into every rank, in place
        (the Parameter objects stay the same, so an optimizer built earlier
        stays valid). A collective: every rank must call it."""
        tensors = [p for p in self.module.parameters()] + [b for b in self.module.buffers()]
        broadcast_in_place(self._backend, tensors, root)

    # ---------------------------------------------------------- module API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, unchanged (local: the gradients are
        reduced in backward and :meth:`sync_gradients`)."""
        return self.module(*args, **kwargs)

    def into_inner(self) -> nn.Module:
        """Remove every hook and return the wrapped module."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        return self.module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The inner module's state dict, with its keys (no ``module.``)."""
        result: dict[str, Any] = self.module.state_dict(*args, **kwargs)
        return result

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict with the inner module's keys."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
