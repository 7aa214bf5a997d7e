"""Elastic FSDP's I/O part: the copy of a buddy's shard each rank keeps, the
gradient each owner hands its buddy at a sync, the copy's optimizer step,
and the re-shard at every change of epoch (see [Note: shards held twice]
in fsdp_reshard.py, which plans it)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..elastic.messages import Segment, as_bytes, messages, unpack
from ..errors import ConfigError, FerroGrpcError, ShardLostError
from ..observe.observer import FSDP_RESHARD
from ..runtime.peer import observer_of
from ..runtime.work import Work
from .fsdp_plan import ShardedParam
from .fsdp_reshard import COPY, OWN, Layout, Lost, Piece, plan

logger = logging.getLogger("ferrogrpc.fsdp")

# The point-to-point tag of a re-shard's pieces.
MOVE_TAG = 0xFE57B001

_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}
_DTYPES.update({str(d): d for d in (torch.int64, torch.int32, torch.uint8, torch.bool)})


class ElasticGroup(Protocol):
    """What the shards need of elastic/backend.py's ElasticBackend (not
    imported here, to keep the import chains short): its current epoch,
    its resharders' list, its sync, and the collectives it forwards."""

    resharders: list[Any]

    @property
    def joining(self) -> bool: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def membership(self) -> Any: ...
    @property
    def peer(self) -> Any: ...
    def run_sync(self, attempt: Callable[[], Callable[[], None]], rerun: bool = ...) -> bool: ...
    def __getattr__(self, name: str) -> Any: ...


class ElasticShards:
    """An FSDP's shards in an elastic group (ElasticBackend.resharders):
    keeps the copy of the shards its layout's buddy rule gives this rank,
    steps it with the owner's gradient, and re-shards at every new epoch.

    ``relayout(world, rank)`` is FSDP's own update once a layout takes
    effect (the shards' sizes changed; their Parameter objects did not);
    ``copies`` are the first epoch's (FSDP cuts them as it cuts shards)."""

    def __init__(
        self,
        entries: Sequence[ShardedParam],
        backend: ElasticGroup,
        relayout: Callable[[int, int], None],
        copies: list[torch.Tensor],
    ) -> None:
        self._entries = list(entries)
        self._backend = backend
        self._relayout = relayout
        self.optimizer: torch.optim.Optimizer | None = None
        self.holds = not backend.joining
        m = backend.membership
        self.layout = Layout(m.epoch, m.world_size, m.hosts) if self.holds else Layout(0, 0, ())
        self.rank = backend.rank if self.holds else -1
        # The copy this rank keeps (of Layout.copy_of's shard), per entry.
        self.copies = copies if self.holds and self.layout.world > 1 else []
        self.copy_state: list[dict[str, Any]] = [{} for _ in self._entries]
        # Set by a hook when a collective of this step failed: the step is
        # void, re-run over the next epoch (ElasticBackend.run_sync).
        self.void: FerroGrpcError | None = None
        self._copy_grads: list[torch.Tensor | None] | None = None
        self._stepping = False
        # The last re-shard this rank took part in: its seconds, the
        # elements the group moved, the bytes this rank received.
        self.last_move: dict[str, float] | None = None
        backend.resharders.append(self)

    # ---------------------------------------------------------- protocol

    def sharded_parameters(self) -> list[torch.Tensor]:
        """The shards: ElasticState leaves them out of its transfer (they
        move here), with their optimizer state."""
        return [e.shard for e in self._entries]

    def held_bytes(self, world: int, moments: int) -> int:
        """What this rank allocates for the shards in a group of ``world``:
        its shard and the copy it keeps, each with ``moments`` optimizer
        tensors of its shape, and the two gradients (a joiner warms its heap
        for them: [Note: a warm heap for a joiner], runtime/allocator.py)."""
        layout = Layout(0, world, ())
        shards = sum(layout.shard_numel(e.numel) * e.shard.element_size() for e in self._entries)
        return shards * (2 * (1 + moments) + 2)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that trains the shards (ElasticState's): its step
        also steps the copies ([Note: shards held twice])."""
        shards = {id(e.shard) for e in self._entries}
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not shards <= mine:
            raise ConfigError(
                "ElasticState: the optimizer must train the FSDP wrapper's parameters "
                "(build it on fsdp.parameters())"
            )
        self.optimizer = optimizer
        optimizer.register_step_post_hook(self._step_copies)

    # -------------------------------------------------------------- sync

    def sync(self, reduce: Callable[[], dict[int, torch.Tensor]]) -> bool:
        """The gradient sync: ``reduce()`` waits for the reduce-scatters and
        gives each trained entry's mean gradient shard (by index); each goes
        to this rank's buddy too, and the shards' ``.grad`` are set once the
        sync is committed. Returns True if the step is void (the group
        changed while it ran): it is re-run over the new group."""

        def attempt() -> Callable[[], None]:
            try:
                grads = reduce()
            except FerroGrpcError:
                if self.void is not None:  # the first failure names the lost rank
                    raise self.void from None
                raise
            if self.void is not None:
                raise self.void
            copy_grads = self._hand_over(grads)

            def write() -> None:
                for i, g in grads.items():
                    self._entries[i].shard.grad = g
                self._copy_grads = copy_grads

            return write

        if self.optimizer is None:
            raise ConfigError(
                "FSDP in an elastic group needs fg.ElasticState(fsdp, optimizer) built before the "
                "first step: it moves the optimizer's state with the shards"
            )
        void = self._backend.run_sync(attempt, rerun=True)
        self.void = None
        if void:
            for e in self._entries:
                e.shard.grad = None
            self._copy_grads = None
        return void

    def failed(self, exc: FerroGrpcError) -> None:
        """A collective of this step failed where its caller cannot take an
        error (a forward or backward hook): the step is void, and the forward
        and backward go on without communication, on zeros, to the sync,
        which re-runs the step over the next epoch. A bad argument still
        raises."""
        if isinstance(exc, ConfigError):
            raise exc
        if self.void is None:
            logger.info("a collective failed inside the step (%s): the step is re-run", exc)
            self.void = exc

    def _trained(self) -> list[int]:
        return [i for i, e in enumerate(self._entries) if e.shard.requires_grad]

    def grad_layout(self) -> tuple[dict[int, int] | None, int]:
        """Where the hand-over lays each trained gradient shard in its one
        message: byte offsets by id of the entry, in the entries' order, and
        the message's size. None where a shard would sit unaligned for its
        dtype (FSDP's units then give each shard a tensor of its own, and
        the hand-over copies them together)."""
        offsets: dict[int, int] = {}
        at = 0
        for i in self._trained():
            e = self._entries[i]
            if at % e.shard.element_size():
                return None, 0
            offsets[id(e)] = at
            at += e.shard_numel * e.shard.element_size()
        return offsets, at

    def _one_buffer(self, grads: dict[int, torch.Tensor], trained: list[int]) -> torch.Tensor:
        """The gradient shards as one byte tensor in grad_layout's order: the
        buffer they already share where FSDP's units put them there (one
        backward since the last sync), else a copy of them together."""
        offsets, total = self.grad_layout()
        storage = grads[trained[0]].untyped_storage()
        base = storage.data_ptr()
        if (
            offsets is not None
            and storage.nbytes() == total
            and all(
                grads[i].untyped_storage().data_ptr() == base
                and grads[i].data_ptr() - base == offsets[id(self._entries[i])]
                for i in trained
            )
        ):
            return torch.empty(0, dtype=torch.uint8).set_(storage)
        return torch.cat([as_bytes(grads[i].contiguous()) for i in trained])

    def _hand_over(self, grads: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
        """Send this rank's gradient shards to its buddy and receive the
        ones of the shard it keeps a copy of: one all_to_all of every
        member, each sending one piece (through the host's shared segments
        where one host holds the group, else over gRPC)."""
        backend, layout = self._backend, self.layout
        buddy, owner = layout.buddy(self.rank), layout.copy_of(self.rank)
        trained = self._trained()
        received: list[torch.Tensor | None] = [None] * len(self._entries)
        if layout.world < 2 or not trained:
            return received
        sizes = [
            self._entries[i].shard_numel * self._entries[i].shard.element_size() for i in trained
        ]
        flat = torch.empty(0, dtype=torch.uint8)
        into = torch.empty(sum(sizes) if owner is not None else 0, dtype=torch.uint8)
        outgoing = [0] * layout.world
        incoming = [0] * layout.world
        if buddy is not None:
            flat = self._one_buffer(grads, trained)
            outgoing[buddy] = flat.numel()
        if owner is not None:
            incoming[owner] = into.numel()
        backend.all_to_all_single(into, flat, incoming, outgoing)
        del flat
        if owner is None:
            return received
        offset = 0
        for i, size in zip(trained, sizes, strict=True):
            # A view of the one buffer where aligned (no second copy at the
            # peak); it lives until the copy's step.
            e = self._entries[i]
            piece = into[offset : offset + size]
            aligned = offset % e.shard.element_size() == 0
            received[i] = (piece if aligned else piece.clone()).view(e.shard.dtype)
            offset += size
        return received

    def _step_copies(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """After the optimizer stepped the shards: the same step on the
        copies, with the same optimizer (its hyperparameters as they are
        now), so that each copy stays bitwise equal to its owner's shard.
        Every other parameter of the optimizer sits this step out."""
        grads, self._copy_grads = self._copy_grads, None
        if self._stepping or grads is None or not self.copies:
            return
        shards = {id(e.shard) for e in self._entries}
        others = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in shards]
        hidden = [(p, p.grad) for p in others]
        saved = [
            (e.shard.data, e.shard.grad, optimizer.state.pop(e.shard, None)) for e in self._entries
        ]
        try:
            for p in others:
                p.grad = None
            for e, copy, state, grad in zip(
                self._entries, self.copies, self.copy_state, grads, strict=True
            ):
                e.shard.data = copy
                e.shard.grad = grad
                optimizer.state[e.shard] = state
            self._stepping = True
            # The step itself, without the optimizer's hooks (this runs in
            # one of them; torch's wrapper keeps the function it wraps).
            step = getattr(type(optimizer).step, "__wrapped__", None)
            if step is not None:
                step(optimizer)
            else:
                optimizer.step()
        finally:
            self._stepping = False
            for i, (e, (data, grad, state)) in enumerate(zip(self._entries, saved, strict=True)):
                self.copy_state[i] = optimizer.state.pop(e.shard, {})
                e.shard.data, e.shard.grad = data, grad
                if state is not None:
                    optimizer.state[e.shard] = state
            for p, g in hidden:
                p.grad = g

    # ------------------------------------------------------------ reshard

    def reshard(self, joined: bool) -> Callable[[], None]:
        """In a new epoch, on every member in rank order: cut the new
        layout's shards and copies out of the old layout's, moved between
        members as the plan says; returns what makes them this process's
        once the change is committed (ElasticBackend._settle). Raises
        ShardLostError if a shard and its copy are both gone."""
        backend = self._backend
        began, began_wall = time.monotonic(), time.time()
        m = backend.membership
        new = Layout(m.epoch, m.world_size, m.hosts)
        me = backend.rank
        holds = self.holds and not joined
        mine = torch.tensor(
            [int(holds), self.layout.epoch if holds else 0, self.rank if holds else -1],
            dtype=torch.int64,
        )
        table = torch.empty(3 * new.world, dtype=torch.int64)
        backend.all_gather_into_tensor(table, mine)
        rows = table.view(new.world, 3).tolist()
        newest = max((r[1] for r in rows if r[0]), default=0)
        holders = {r[2]: j for j, r in enumerate(rows) if r[0] and r[1] == newest}
        if not holders:
            raise self._lost(backend, [], [], "no member holds the group's shards")
        meta = self._meta(backend, min(holders.values()), holds)
        old = Layout(int(meta["epoch"]), int(meta["world"]), tuple(meta["hosts"]))
        try:
            pieces = plan([e.numel for e in self._entries], old, holders, new)
        except Lost as lost:
            gone = sorted(set(range(old.world)) - set(holders))
            raise self._lost(backend, gone, lost.shards, str(lost)) from None
        planes = meta["planes"]
        own, copy, received, arrival = self._move(backend, pieces, planes, new, me)
        moved = sum(p.length for p in pieces if p.src != p.dst)

        def swap() -> None:
            self._take(own, copy, planes, meta["scalars"], new, me)
            seconds = time.monotonic() - began
            # ("arrival": from the exchange's start (after the plan) to the
            # last received message's end; "seconds": the whole re-shard.)
            self.last_move = {
                "seconds": seconds,
                "elements": float(moved),
                "bytes": float(received),
                "arrival": arrival,
            }
            # The trace's span and the metrics' re-shard count and seconds
            # (observe/metrics.py), on the new epoch's observer.
            observer_of(backend.peer).record(
                FSDP_RESHARD,
                f"re-shard {old.world} -> {new.world} ranks",
                began_wall,
                began_wall + seconds,
                epoch=new.epoch,
                world_size=new.world,
                from_world_size=old.world,
                elements=moved,
                received_bytes=received,
            )
            logger.info(
                "epoch %d: shards re-laid over %d ranks (from %d), %d elements moved in %.3f s",
                new.epoch,
                new.world,
                old.world,
                moved,
                seconds,
            )

        return swap

    def _lost(
        self, backend: ElasticGroup, gone: list[int], shards: list[int], why: str
    ) -> ShardLostError:
        return ShardLostError(
            f"the FSDP group lost shards {shards} of its layout with every copy of them "
            f"(ranks {gone} of that layout are gone: an owner and its buddy at once): {why}; "
            "training cannot go on from memory: resume from the last sharded checkpoint "
            "(load_sharded_state_dict) or a full_state_dict() saved earlier",
            lost=gone,
            shards=shards,
            rank=backend.rank,
            world_size=backend.world_size,
        )

    def _meta(self, backend: ElasticGroup, source: int, holds: bool) -> dict[str, Any]:
        """The old layout and each entry's optimizer state planes (keys and
        dtypes of the tensors shaped like the shard) and scalars, as the
        lowest holder has them, broadcast to every member."""
        raw = b""
        if backend.rank == source:
            planes: list[list[list[str]]] = []
            scalars: list[dict[str, list[Any]]] = []
            for e in self._entries:
                state = self.optimizer.state.get(e.shard, {}) if self.optimizer else {}
                keys: list[list[str]] = []
                values: dict[str, list[Any]] = {}
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor) and value.shape == (e.shard_numel,):
                        keys.append([key, str(value.dtype)])
                    elif isinstance(value, torch.Tensor) and value.dim() == 0:
                        values[key] = [value.item(), str(value.dtype)]
                    elif isinstance(value, bool | int | float) or value is None:
                        values[key] = [value, None]
                    else:
                        raise ConfigError(
                            f"FSDP in an elastic group: the optimizer's state {key!r} of "
                            f"{e.name} is neither shaped like the shard nor a scalar; it "
                            "cannot move with the shards"
                        )
                planes.append(keys)
                scalars.append(values)
            raw = json.dumps(
                {
                    "epoch": self.layout.epoch,
                    "world": self.layout.world,
                    "hosts": list(self.layout.hosts),
                    "planes": planes,
                    "scalars": scalars,
                }
            ).encode()
        length = torch.tensor([len(raw)], dtype=torch.int64)
        backend.broadcast(length, source)
        body = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
        if body is None:
            body = torch.empty(int(length.item()), dtype=torch.uint8)
        backend.broadcast(body, source)
        meta: dict[str, Any] = json.loads(bytes(body.tolist()))
        return meta

    def _planes(self, i: int, role: int, planes: list[list[list[str]]]) -> list[torch.Tensor]:
        """Entry ``i``'s tensors of one role, in plane order: the parameter
        shard (or its copy), then its optimizer state shaped like it."""
        e = self._entries[i]
        if role == OWN:
            state = self.optimizer.state.get(e.shard, {}) if self.optimizer else {}
            first = e.shard.detach()
        else:
            state, first = self.copy_state[i], self.copies[i]
        return [first, *(state[key] for key, _ in planes[i])]

    def _move(
        self,
        backend: ElasticGroup,
        pieces: list[Piece],
        planes: list[list[list[str]]],
        new: Layout,
        me: int,
    ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], int, float]:
        """Send and receive the pieces; the new layout's planes (own, copy),
        the bytes this rank received, and the seconds from the exchange's
        start to the last received message's end."""
        began = time.perf_counter()
        dtypes = [
            [e.shard.dtype, *(_DTYPES[d] for _, d in planes[i])]
            for i, e in enumerate(self._entries)
        ]

        # Each piece's planes, as byte views: from the old planes to send
        # (unchanged until the swap), into the new planes to receive. Both
        # sides list a pair's pieces in plan order, planes in order, and
        # cut them into the same messages (elastic/messages.py). The sends
        # go first, so that the others' receipts start while this rank
        # allocates its new planes; a large piece is received straight
        # into its place, every receive posted at once.
        outgoing: dict[int, list[torch.Tensor]] = {}
        for p in pieces:
            if p.src == me and p.dst != me:
                outgoing.setdefault(p.dst, []).extend(
                    as_bytes(src[p.src_lo : p.src_lo + p.length])
                    for src in self._planes(p.entry, p.src_role, planes)
                )
        works: list[Work[Any]] = []
        for peer, views in outgoing.items():
            sizes = [v.numel() for v in views]
            for message in messages(sizes, 0, sum(sizes)):
                if len(message) == 1:
                    data = views[message[0].tensor][message[0].lo : message[0].hi]
                else:
                    data = torch.cat([views[g.tensor][g.lo : g.hi] for g in message])
                works.append(backend.send(data, peer, MOVE_TAG, async_op=True))
        sends = len(works)
        out = {role: self._fresh(role, pieces, dtypes, new, me) for role in (OWN, COPY)}
        incoming: dict[int, list[torch.Tensor]] = {}
        for p in pieces:
            if p.dst != me:
                continue
            into = out[p.dst_role][p.entry]
            if p.src == me:
                sources = self._planes(p.entry, p.src_role, planes)
                for src, dst in zip(sources, into, strict=True):
                    dst[p.dst_lo : p.dst_lo + p.length] = src[p.src_lo : p.src_lo + p.length]
            else:
                incoming.setdefault(p.src, []).extend(
                    as_bytes(dst[p.dst_lo : p.dst_lo + p.length]) for dst in into
                )
        staged: list[tuple[Work[Any], list[Segment], torch.Tensor, list[torch.Tensor]]] = []
        received = 0
        for peer, views in sorted(incoming.items()):
            sizes = [v.numel() for v in views]
            received += sum(sizes)
            for message in messages(sizes, 0, sum(sizes)):
                if len(message) == 1:
                    seg = message[0]
                    into_bytes = views[seg.tensor][seg.lo : seg.hi]
                    works.append(backend.recv(into_bytes, peer, MOVE_TAG, async_op=True))
                else:
                    buf = torch.empty(sum(g.hi - g.lo for g in message), dtype=torch.uint8)
                    work = backend.recv(buf, peer, MOVE_TAG, async_op=True)
                    staged.append((work, message, buf, views))
        ends = [w.when_done() for w in [*works[sends:], *(s[0] for s in staged)]]
        for work, message, buf, views in staged:
            work.wait()
            unpack(buf, message, views)
        for work in works:
            work.wait()
        stamps = [e.result() for e in ends]
        arrival = max(stamps) - began if stamps else 0.0
        return out[OWN], out[COPY], received, arrival

    def _fresh(
        self, role: int, pieces: list[Piece], dtypes: list[list[torch.dtype]], new: Layout, me: int
    ) -> list[list[torch.Tensor]]:
        """The new layout's planes of one role on this rank, uninitialised
        where the plan's pieces will fill them and zero elsewhere (the
        padding past a parameter's end)."""
        if role == COPY and new.copy_of(me) is None:
            return [[] for _ in self._entries]
        filled: dict[int, list[tuple[int, int]]] = {}
        for p in pieces:
            if p.dst == me and p.dst_role == role:
                filled.setdefault(p.entry, []).append((p.dst_lo, p.dst_lo + p.length))
        out = []
        for i, e in enumerate(self._entries):
            n = new.shard_numel(e.numel)
            planes = [torch.empty(n, dtype=d) for d in dtypes[i]]
            at = 0
            for lo, hi in [*sorted(filled.get(i, [])), (n, n)]:
                if lo > at:
                    for plane in planes:
                        plane[at:lo] = 0
                at = max(at, hi)
            out.append(planes)
        return out

    def _take(
        self,
        own: list[list[torch.Tensor]],
        copy: list[list[torch.Tensor]],
        planes: list[list[list[str]]],
        scalars: list[dict[str, list[Any]]],
        new: Layout,
        me: int,
    ) -> None:
        """Make the new layout this process's: the shards' data (same
        Parameter objects, so the optimizer still trains them), their
        optimizer state, the copies and theirs."""

        def state_of(i: int, tensors: list[torch.Tensor]) -> dict[str, Any]:
            state: dict[str, Any] = {}
            for (key, _), t in zip(planes[i], tensors[1:], strict=True):
                state[key] = t
            for key, (value, dtype) in scalars[i].items():
                state[key] = value if dtype is None else torch.tensor(value, dtype=_DTYPES[dtype])
            return state

        with torch.no_grad():
            for i, e in enumerate(self._entries):
                e.shard.data = own[i][0]
                e.shard.grad = None
                if self.optimizer is not None:
                    if planes[i] or scalars[i]:
                        self.optimizer.state[e.shard] = state_of(i, own[i])
                    else:
                        self.optimizer.state.pop(e.shard, None)
        self.copies = [c[0] for c in copy] if new.copy_of(me) is not None else []
        self.copy_state = [state_of(i, c) if c else {} for i, c in enumerate(copy)]
        self.layout, self.rank, self.holds = new, me, True
        self._copy_grads = None
        self._relayout(new.world, me)
