"""What a joiner of an elastic group receives: ``ElasticState``.

The state is the model's parameters and buffers, the optimizer's state, the
step index and a JSON-able ``extra``. It travels as a JSON header (names,
dtypes, shapes, the optimizer's class, hyperparameters and the non-tensor
values of its state, the step, ``extra``) and one byte stream: every
tensor's raw bytes, in header order. The stream is cut into as many stripes
as there are members, and member i sends stripe i to every joiner, all
members at once, as point-to-point messages of the epoch's peer: checksummed
per part and sent only to an admitted, known peer (see p2p.py). Nothing is
pickled. A joiner checks the header against its own model and optimizer
before it allocates anything (see [Note: what a joiner accepts]); the
header's codec is header.py.

[Note: the state in two parts]
The stream is two parts, each striped over the members: the model's
parameters and buffers, then the optimizer's state (Adam's two moments:
two thirds of the bytes). The members' pause at a boundary that admits a
joiner lasts until the model's part has landed: then the joiner loads it
and runs its first forward and backward while the optimizer's part is
still arriving. Members send that part from their own tensors, unchanged
until their optimizer's next step; so both sides finish it
(:meth:`ElasticState.finish_transfer`) when the step's gradient sync
begins (ElasticBackend.run_sync), and at the next boundary if a step had
no sync. An optimizer step before either (a step with no sync) finishes it
first: ElasticState hooks the optimizer's step. Nothing at the admitting
boundary waits for it, except a second grow there: a member sends only a
state it holds whole. A joiner whose receipt fails is *incomplete*: it
joins again, as a joiner, and receives the whole state anew.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, FerroGrpcError, ProtocolError
from ..runtime.allocator import warm_heap
from ..runtime.work import Work
from .backend import ElasticBackend
from .header import (
    Header,
    Limits,
    Own,
    Sender,
    check_length,
    class_name,
    encode,
    encode_header,
    encode_refusal,
    hyperparameters,
    model_count,
    outgoing,
    read_header,
    resolve,
)
from .messages import Segment as _Segment
from .messages import as_bytes as _bytes
from .messages import messages as _messages
from .messages import stripes as _stripes
from .messages import unpack

logger = logging.getLogger("ferrogrpc.elastic")

# Point-to-point tags of the state transfer (users' tags are best kept
# below these).
HEADER_TAG = 0xFE57A7E0
DATA_TAG = HEADER_TAG + 1


def _moments_per_parameter(group: dict[str, Any], optimizer: torch.optim.Optimizer) -> int:
    """How many tensors of each parameter's shape ``optimizer`` keeps for
    the parameters of ``group`` once it has stepped: torch's own
    optimizers; 0 for the others."""
    optim = torch.optim
    if isinstance(optimizer, optim.Adam | optim.AdamW):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, optim.NAdam | optim.RAdam | optim.Adamax | optim.Adadelta):
        return 2
    if isinstance(optimizer, optim.SGD):
        return 1 if group.get("momentum") else 0
    if isinstance(optimizer, optim.RMSprop):
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    return 0


def _adopt(group: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The group's hyperparameters now, into this process's ``group``; a
    tensor one in place where it has the same shape and dtype here (a
    scheduler may hold it)."""
    with torch.no_grad():
        for key, value in theirs.items():
            mine = group.get(key)
            if (
                isinstance(mine, torch.Tensor)
                and isinstance(value, torch.Tensor)
                and (mine.shape, mine.dtype) == (value.shape, value.dtype)
            ):
                mine.copy_(value)
            else:
                group[key] = value


# ------------------------------------------------------------- the stream


@dataclasses.dataclass
class _Receiving:
    """A joiner's receipt of the optimizer's part, still landing."""

    works: list[tuple[Work[Any], list[_Segment], torch.Tensor | None]]
    stamps: list[concurrent.futures.Future[float]]  # when each landed
    targets: list[torch.Tensor]
    header: Header
    start: float
    model_done: float  # when the model's part had landed
    model_bytes: int
    members: int


def _land(
    works: list[tuple[Work[Any], list[_Segment], torch.Tensor | None]],
    targets: list[torch.Tensor],
) -> None:
    """Wait for every receive; copy each packed message into its tensors."""
    for work, packed, staged in works:
        work.wait()
        if staged is not None:
            unpack(staged, packed, targets)


class ElasticState:
    """What a process joining an elastic group receives from its members:
    ``model``'s parameters and buffers, ``optimizer``'s state, the step
    index and ``extra`` (JSON-able: numbers, strings, lists, dicts).

    ``model`` is an ``fg.DDP`` over an elastic backend
    (``init_backend(elastic=True)``). Build the state before the first step,
    on every process, members and joiners alike, with the same optimizer:
    its class and its hyperparameters as built here must be the group's (a
    joiner adopts the group's hyperparameters as they are now, which a
    scheduler may have changed). The optimizer's state may hold tensors,
    None, bools, ints, floats, strs, and tuples, lists and str-keyed dicts
    of them (LBFGS's lists of tensors too); see [Note: values in the state
    header].

    ``state.step`` is the current step index; ``state.extra`` holds the
    group's ``extra`` once a joiner received it (members may change theirs
    between steps: a joiner gets it as it is at the boundary where it is
    admitted).

    Synchronizes: ``steps()`` at each step boundary (see
    :meth:`ElasticBackend.boundary`). Failure: a member lost while the state
    is sent fails the transfer on the joiners and the members; the group then
    forms again without it, and the joiners receive the state anew. A joiner
    that cannot take the group's state (the errors below) leaves the group:
    the members go on without it, as without any lost member.

    Raises:
        ConfigError: ``model`` is not a DDP over an elastic backend,
            ``extra`` is not JSON-able, a hyperparameter (here) or the
            optimizer's state (from its first step on) holds a value it
            cannot send, or (on a joiner, from ``steps()``) its model or
            optimizer differs from the members' (the first name, shape,
            dtype, class or hyperparameter it differs in is named).
        ProtocolError: (on a joiner, from ``steps()``) the members' state
            header is malformed; it names the sender.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None
    ) -> None:
        backend = getattr(model, "backend", None)
        if not isinstance(backend, ElasticBackend):
            raise ConfigError(
                "ElasticState needs a model wrapped by fg.DDP over an elastic backend "
                "(fg.init_backend(coordinator=..., elastic=True))"
            )
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"ElasticState: extra must be JSON-able: {exc}") from None
        broadcast = getattr(model, "broadcast_parameters", None)
        inner = getattr(model, "module", None)
        # An fg.FSDP registered its shards with the backend: they move with
        # the group's layout, not in this transfer ([Note: shards held
        # twice] in wrappers/fsdp_reshard.py).
        sharded = bool(backend.resharders)
        if (broadcast is None and not sharded) or not isinstance(inner, nn.Module):
            raise ConfigError(
                "ElasticState needs the fg.DDP or fg.FSDP wrapper itself, not its module"
            )
        for resharder in backend.resharders:
            resharder.attach(optimizer)
        self._sharded = frozenset(id(p) for r in backend.resharders for p in r.sharded_parameters())
        self._wrapper: Any = model
        self.model = inner
        self.optimizer = optimizer
        self.extra = extra
        self.step = 0
        self._backend: ElasticBackend = backend
        self._started = False
        self._rejoined = False
        # The last state this process received: {"bytes", "seconds",
        # "members"} (for benchmarks and logs); None until then.
        self.last_transfer: dict[str, float] | None = None
        # What the last transfer left running (send_to_joiners,
        # receive_from_members; finish_transfer ends it), and whether this
        # process lacks part of the group's state (a receipt that failed).
        self._sending: list[Work[Any]] = []
        self._receiving: _Receiving | None = None
        self.incomplete = False
        # What every process's optimizer must have been built with, the
        # group's (sent to joiners): ConfigError names what cannot be sent.
        self._configured = hyperparameters(optimizer.param_groups)
        self._limits = Limits.of(optimizer)
        for name, t in [*inner.named_parameters(), *inner.named_buffers()]:
            encode(t, name, [])  # a dtype or layout it cannot send: ConfigError
        if backend.joining:
            # What it allocates once admitted, faulted in while it waits:
            # [Note: a warm heap for a joiner] (runtime/allocator.py). Per
            # parameter byte: its gradient, DDP's two buckets (the second is
            # filled by the second step), the optimizer's, and one more for
            # what the transfer passes through meanwhile (gRPC's buffers).
            # An FSDP's shards are empty until then: they are sized for the
            # world the last heartbeat foretold (its members, the joiners
            # waiting, and this process).
            moments = [_moments_per_parameter(g, optimizer) for g in optimizer.param_groups]
            heard = backend._client.latest
            world = heard.world_size + heard.joiners_waiting + 1 if heard is not None else 0
            warm_heap(
                sum(
                    p.numel() * p.element_size() * (4 + n)
                    for group, n in zip(optimizer.param_groups, moments, strict=True)
                    for p in group["params"]
                    if p.device.type == "cpu"
                )
                + sum(
                    r.held_bytes(world, max(moments, default=0))
                    for r in backend.resharders
                    if world > 1
                )
            )
        optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._first_step = optimizer.register_step_post_hook(self._after_first_step)
        backend.state = self

    # ------------------------------------------------------------- the loop

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step indices up to ``total``, at each step boundary
        admitting the processes that wait to join. On a joiner (and on a
        member that was removed and joined again), the first index is the
        group's current step, received with the state.

        Raises:
            QuorumLostError: fewer than ``min_world_size`` members remain.
            ConfigError: (a joiner) its model or optimizer differs from the
                group's; it left the group.
            ProtocolError: (a joiner) the group's state header is
                malformed; it left the group.
        """
        backend = self._backend
        if not self._started:
            self._started = True
            first = not backend.joining and backend.membership.epoch == 1 and self.step == 0
            if first and not self._sharded:  # (FSDP started from rank 0's weights)
                self._same_start()
        step = self.step
        while True:
            self._rejoined = False
            if backend.boundary(step):
                step = self.step
            if step >= total:
                return
            self.step = step
            yield step
            step = self.step if self._rejoined else step + 1
            self.step = step

    def _same_start(self) -> None:
        """The first epoch's members start from rank 0's parameters and
        buffers (redone in the next epoch if a member is lost meanwhile).
        A member removed meanwhile (stalled) joins again and receives the
        group's state instead: the others are past this broadcast."""
        while True:
            try:
                self._wrapper.broadcast_parameters(0)
                return
            except FerroGrpcError as exc:
                if self._backend.recover(exc):
                    return

    def rejoined(self) -> None:
        """This process joined again inside a step (DDP's sync): the step it
        ran is discarded, and the next one is the group's (``self.step``)."""
        self._rejoined = True

    # ------------------------------------------------------------ the state

    def _after_first_step(self, *_: Any) -> None:
        """After the optimizer's first step, its state exists: one that
        cannot be sent is refused now, on every process alike, rather than
        at the first join (see [Note: values in the state header])."""
        self._first_step.remove()
        outgoing(self.model, self.optimizer, self._limits, self._sharded)

    def send_to_joiners(self, joined_from: int) -> None:
        """On a member of a new epoch: send ranks ``joined_from`` and above
        (the joiners) this process's stripe of the state; rank 0 sends the
        header too. Blocks until the model's part is sent; the optimizer's
        part goes on in the background, finished by :meth:`finish_transfer`
        (the gradient sync calls it) before the optimizer can change it
        (see [Note: the state in two parts]). A state it cannot send is
        refused in the header instead: the joiners raise and leave, and this
        member goes on (see [Note: values in the state header])."""
        backend = self._backend
        rank, world = backend.rank, backend.world_size
        refusal: str | None = None
        named: list[tuple[str, torch.Tensor]] = []
        try:
            named, optimizer = outgoing(self.model, self.optimizer, self._limits, self._sharded)
            raw = (
                encode_header(named, optimizer, backend.step_index, self.extra, self._configured)
                if rank == 0
                else b""
            )
        except ConfigError as exc:
            refusal = exc.message
            raw = encode_refusal(refusal)
        works: list[Work[Any]] = []
        if rank == 0:
            body = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            length = torch.tensor([len(raw)], dtype=torch.int64)
            for joiner in range(joined_from, world):
                works.append(backend.send(length, joiner, HEADER_TAG, async_op=True))
                works.append(backend.send(body, joiner, HEADER_TAG, async_op=True))
        if refusal is not None:
            logger.warning(
                "refusing ranks %d..%d the group's state: %s", joined_from, world - 1, refusal
            )
            for work in works:
                work.wait()
            self._sending = []
            return
        cpu = [
            t.contiguous().cpu() if (t.device.type != "cpu" or not t.is_contiguous()) else t
            for _, t in named
        ]
        model = model_count([name for name, _ in named])
        sent = 0
        for part in (range(model), range(model, len(cpu))):
            tensors = [cpu[i] for i in part]
            sizes = [t.numel() * t.element_size() for t in tensors]
            lo, hi = _stripes(sum(sizes), joined_from)[rank]
            sent += hi - lo
            for message in _messages(sizes, lo, hi):
                if len(message) == 1:
                    seg = message[0]
                    data = _bytes(tensors[seg.tensor])[seg.lo : seg.hi]
                else:
                    data = torch.cat([_bytes(tensors[s.tensor])[s.lo : s.hi] for s in message])
                for joiner in range(joined_from, world):
                    works.append(backend.send(data, joiner, DATA_TAG, async_op=True))
            if part.start == 0:
                for work in works:
                    work.wait()
                works = []
        self._sending = works
        total = sum(t.numel() * t.element_size() for t in cpu)
        logger.info(
            "sending %d of %d state bytes to ranks %d..%d", sent, total, joined_from, world - 1
        )

    def receive_from_members(self, joined_from: int) -> int:
        """On a joiner: receive the state from members ``0 .. joined_from -
        1`` (the header from rank 0), check it against this process's model
        and optimizer ([Note: what a joiner accepts]), and load the model's
        part. Returns the group's step index. The optimizer's part arrives
        in the background; :meth:`finish_transfer` loads it.

        Raises:
            ConfigError, ProtocolError: this process cannot take the
                group's state; it left the group (its backend is closed).
        """
        backend = self._backend
        start = time.perf_counter()
        self.incomplete = True
        members = backend.membership.members
        sender = Sender(0, backend.rank, backend.world_size, members[0] if members else None)
        length = torch.zeros(1, dtype=torch.int64)
        backend.recv(length, 0, HEADER_TAG)
        try:
            body = torch.empty(check_length(int(length.item()), sender), dtype=torch.uint8)
        except ProtocolError:
            self._leave()
            raise
        backend.recv(body, 0, HEADER_TAG)
        try:
            header = read_header(bytes(body.numpy()), self._own(), sender)
        except (ConfigError, ProtocolError):
            self._leave()
            raise
        targets = self._targets(header.specs)
        model = header.model
        # What the joiner's first step may read comes with the header, now:
        # the group's ``extra`` and its optimizer settings (lr, ...). The
        # optimizer's tensors follow (finish_transfer), and keep the
        # settings as the step leaves them.
        self.extra = header.extra
        for group, theirs in zip(self.optimizer.param_groups, header.groups, strict=True):
            _adopt(group, theirs)
        _land(self._receive_part(targets, range(model), joined_from), targets)
        model_done = time.perf_counter()
        index = {name: i for i, (name, _, _) in enumerate(header.specs)}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                self._copy_into(p, f"param:{name}", index, targets)
            for name, b in self.model.named_buffers():
                self._copy_into(b, f"buffer:{name}", index, targets)
        for p in self.model.parameters():
            p.grad = None
        rest = self._receive_part(targets, range(model, len(targets)), joined_from)
        stamps = [work.when_done() for work, _, _ in rest]
        model_bytes = sum(t.numel() * t.element_size() for t in targets[:model])
        self._receiving = _Receiving(
            rest, stamps, targets, header, start, model_done, model_bytes, joined_from
        )
        return header.step

    def _own(self) -> Own:
        """What this process checks a header against."""
        tensors = {f"param:{name}": (p.dtype, p.shape) for name, p in self.model.named_parameters()}
        tensors.update(
            {f"buffer:{name}": (b.dtype, b.shape) for name, b in self.model.named_buffers()}
        )
        groups = self.optimizer.param_groups
        state = {
            int(key): {
                field: (value.dtype, value.shape)
                for field, value in entry.items()
                if isinstance(value, torch.Tensor)
            }
            for key, entry in self.optimizer.state_dict()["state"].items()
        }
        return Own(
            tensors=tensors,
            optimizer_class=class_name(self.optimizer),
            configured=self._configured,
            group_sizes=[len(g["params"]) for g in groups],
            params=[p.shape for g in groups for p in g["params"]],
            limits=self._limits,
            state=state,
        )

    def _leave(self) -> None:
        """This process cannot take the group's state: it leaves the group
        (see [Note: what a joiner accepts]). Its backend is closed, so the
        error reaches the caller of ``steps()`` rather than a recovery."""
        logger.warning("this process cannot take the group's state: it leaves the group")
        self._backend.close()

    def _receive_part(
        self, targets: list[torch.Tensor], part: range, joined_from: int
    ) -> list[tuple[Work[Any], list[_Segment], torch.Tensor | None]]:
        """Post the receives of the tensors ``part`` of ``targets`` (each
        member's stripe of them); return the works, with where a packed
        message's bytes go."""
        backend = self._backend
        tensors = [targets[i] for i in part]
        sizes = [t.numel() * t.element_size() for t in tensors]
        works: list[tuple[Work[Any], list[_Segment], torch.Tensor | None]] = []
        for member, (lo, hi) in enumerate(_stripes(sum(sizes), joined_from)):
            for message in _messages(sizes, lo, hi):
                if len(message) == 1:
                    seg = message[0]
                    into = _bytes(tensors[seg.tensor])[seg.lo : seg.hi]
                    works.append((backend.recv(into, member, DATA_TAG, async_op=True), [], None))
                else:
                    packed = [dataclasses.replace(g, tensor=part[g.tensor]) for g in message]
                    buf = torch.empty(sum(g.hi - g.lo for g in message), dtype=torch.uint8)
                    works.append((backend.recv(buf, member, DATA_TAG, async_op=True), packed, buf))
        return works

    def finish_transfer(self) -> None:
        """Finish what the last state transfer left running: on a member,
        the optimizer's part still being sent; on a joiner, its receipt,
        loaded into the optimizer. Raises FerroGrpcError if it failed (a
        joiner is then :attr:`incomplete`, and must receive it again)."""
        sending, self._sending = self._sending, []
        receiving, self._receiving = self._receiving, None
        for work in sending:
            work.wait()
        if receiving is None:
            return
        _land(receiving.works, receiving.targets)
        done = max([receiving.model_done, *(t.result() for t in receiving.stamps)])
        self._load_optimizer(receiving.targets, receiving.header)
        self.incomplete = False
        # The transfer's time: until its last byte landed (not until this
        # call, which comes after the joiner's first backward).
        seconds = done - receiving.start
        nbytes = sum(t.numel() * t.element_size() for t in receiving.targets)
        # The model's part alone, too: nothing else runs while it lands,
        # where the optimizer's part shares the cores with the first step.
        self.last_transfer = {
            "bytes": nbytes,
            "seconds": seconds,
            "members": receiving.members,
            "model_bytes": receiving.model_bytes,
            "model_seconds": receiving.model_done - receiving.start,
        }
        logger.info(
            "received %d state bytes from %d members in %.3fs", nbytes, receiving.members, seconds
        )

    def _before_optimizer_step(self, *_: Any) -> None:
        """An optimizer step while a transfer is in flight (a step with no
        gradient sync, which would have finished it) first lets it end: a
        member sends from the optimizer's live tensors, and a joiner loads
        them. A failure here is not raised from ``optimizer.step()``: the
        next sync or boundary recovers from it, as after any lost peer (a
        joiner whose receipt failed is :attr:`incomplete`, and joins again)."""
        try:
            self.finish_transfer()
        except FerroGrpcError as exc:
            logger.info("the state transfer failed before an optimizer step: %s", exc)

    def abandon_transfer(self) -> None:
        """Forget what the last transfer left running, without waiting: its
        epoch ended (:meth:`ElasticBackend.recover`), so it cannot complete.
        A joiner stays :attr:`incomplete` until it receives the state anew."""
        self._sending, self._receiving = [], None

    def _targets(self, specs: list[tuple[str, torch.dtype, torch.Size]]) -> list[torch.Tensor]:
        """Where each tensor of the stream (checked: read_header) lands:
        this process's parameters and buffers (when on the CPU and
        contiguous), new tensors for the rest."""
        mine: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            mine[f"param:{name}"] = p.detach()
        for name, b in self.model.named_buffers():
            mine[f"buffer:{name}"] = b.detach()
        targets: list[torch.Tensor] = []
        for name, dtype, shape in specs:
            own = mine.get(name)
            if own is not None and own.device.type == "cpu" and own.is_contiguous():
                targets.append(own)
            else:
                targets.append(torch.empty(shape, dtype=dtype))
        return targets

    def _load_optimizer(self, targets: list[torch.Tensor], header: Header) -> None:
        """The optimizer's state from ``targets``; its settings as they are
        (received with the header, see receive_from_members)."""
        groups = self.optimizer.state_dict()["param_groups"]
        state = {key: resolve(entry, targets) for key, entry in header.state.items()}
        # A sharded model's shards keep the state that moved with them.
        kept = {p: st for p, st in self.optimizer.state.items() if id(p) in self._sharded}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.optimizer.state.update(kept)

    @staticmethod
    def _copy_into(
        t: torch.Tensor, name: str, index: dict[str, int], targets: list[torch.Tensor]
    ) -> None:
        source = targets[index[name]]
        if source is not t and source.data_ptr() != t.data_ptr():
            t.copy_(source)
