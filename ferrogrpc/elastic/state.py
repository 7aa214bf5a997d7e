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
before it allocates anything (see [Note: what a joiner accepts]).

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

[Note: values in the state header]
A hyperparameter, or a value of the optimizer's state that is not a
tensor, travels in the header as itself when it is None, a bool, an int, a
float or a str, and otherwise tagged, so that it comes back as the same
type: ``{"tuple": [...]}``, ``{"list": [...]}``, ``{"dict": {str: ...}}``;
a tensor of the state as ``{"stream": i}``, the stream's i-th tensor (LBFGS
keeps lists of them); a small tensor hyperparameter (a scheduler's tensor
``lr``) inline, as ``{"tensor": [dtype, shape, values]}``. Floats survive
JSON exactly (their repr), so hyperparameters compare exactly. Anything
else (an object, a sparse tensor, an unsupported dtype) cannot be sent:
ElasticState refuses a hyperparameter of that kind when it is built, and
state of that kind after the optimizer's first step, on every process
alike; a member that meets one at a join (state that changed kind later)
sends the joiner a refusal in the header instead of the state: the joiner
raises, and the members go on.

[Note: what a joiner accepts]
A state header comes from another process: the joiner parses it as
hostile before it allocates anything. Malformed (not JSON, wrong types,
an unknown dtype, a reference out of range, more bytes than the group's
model and optimizer can hold) is a ProtocolError naming the sender; one
that differs from this process's model (names, dtypes, shapes) or
optimizer (class, hyperparameters as each process built them, the shape
and dtype of a state tensor both hold) is a ConfigError naming the first
difference. The optimizer's state is bounded by its parameters: a state
tensor is a scalar, or has its parameter's shape (torch's per-parameter
optimizers), or holds at most its parameter's elements (others; LBFGS: all
parameters'); an entry holds at most TENSORS_PER_ENTRY tensors, and all of
them together at most STATE_PER_ELEMENT elements per parameter element
(LBFGS: two per element per step of its history, and two more); a member
refuses to send a state beyond those bounds, so a joiner never meets one
from a group like itself. A joiner that cannot take the group's state
leaves the group (it closes its backend): the members, which wait for it
in the new epoch, find it gone and go on without it, as without any lost
member, and the error reaches the joiner's ``steps()``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, FerroGrpcError, ProtocolError
from ..runtime.allocator import warm_heap
from ..runtime.work import Work
from .backend import ElasticBackend

logger = logging.getLogger("ferrogrpc.elastic")

# Point-to-point tags of the state transfer (users' tags are best kept
# below these).
HEADER_TAG = 0xFE57A7E0
DATA_TAG = HEADER_TAG + 1
# The most bytes one message of a stripe carries; a segment smaller than
# PACK_BELOW is packed with its neighbours into one message.
MESSAGE_BYTES = 32 * 2**20
PACK_BELOW = 4 * 2**20
FORMAT = 3  # 3: the optimizer's class, hyperparameters as built, tagged values
# The bounds of a header ([Note: what a joiner accepts]): its bytes; the
# elements of a tensor hyperparameter it carries inline; how deep its values
# nest; the optimizer's state tensors, an entry's and per parameter element.
HEADER_BYTES_MAX = 64 * 2**20
INLINE_NUMEL_MAX = 64
DEPTH_MAX = 16
TENSORS_PER_ENTRY = 64
STATE_PER_ELEMENT = 4

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclasses.dataclass(frozen=True)
class _Segment:
    tensor: int  # index into the tensor list
    lo: int  # byte range within that tensor
    hi: int


def _dtype_name(dtype: torch.dtype, what: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"ElasticState: {what} has dtype {dtype}, which it cannot send")
    return name


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


def _model_count(names: list[str]) -> int:
    """How many of the stream's tensors (in order) are the model's: the
    parameters and buffers come first, the optimizer's state after."""
    return sum(1 for name in names if not name.startswith("optimizer:"))


# ------------------------------------------------ the optimizer, in a header


# torch's optimizers whose state is, per parameter, tensors of its shape
# and scalars (a step count, NAdam's mu_product).
_SHAPED = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


@dataclasses.dataclass(frozen=True)
class _Limits:
    """The state an optimizer keeps ([Note: what a joiner accepts]): a
    state tensor has its parameter's shape (``shaped``: torch's
    per-parameter optimizers), or at most its elements, or (``flat``:
    LBFGS's vectors) at most all parameters'; or it is a scalar. And the
    tensors of one entry, and the elements of all of them per parameter
    element."""

    shaped: bool
    flat: bool
    tensors_per_entry: int
    per_element: int

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> _Limits:
        if isinstance(optimizer, torch.optim.LBFGS):
            # d, prev_flat_grad, and two vectors a step of its history;
            # ro, al, H_diag and t are scalars.
            history = int(optimizer.param_groups[0]["history_size"])
            return _Limits(False, True, 4 * history + 8, 2 * history + 2)
        shaped = isinstance(optimizer, _SHAPED)
        return _Limits(shaped, False, TENSORS_PER_ENTRY, STATE_PER_ELEMENT)

    def error(
        self, entries: dict[int, list[tuple[str, torch.Size]]], params: list[torch.Size]
    ) -> str | None:
        """What breaks these limits in a state whose entries hold tensors of
        (name, shape), for the parameters of ``params`` shapes (by index);
        None if nothing does."""
        everything = sum(p.numel() for p in params)
        total = 0
        for key, tensors in entries.items():
            if len(tensors) > self.tensors_per_entry:
                return (
                    f"state[{key}] holds {len(tensors)} tensors, more than {self.tensors_per_entry}"
                )
            param = params[key]
            most = everything if self.flat else param.numel()
            for where, shape in tensors:
                numel = shape.numel()
                if numel <= 1:
                    pass
                elif self.shaped and shape != param:
                    return f"{where} has shape {_shape(shape)}, parameter {key} {tuple(param)}"
                elif numel > most:
                    return (
                        f"{where} holds {numel} elements, more than "
                        + ("the parameters'" if self.flat else f"parameter {key}'s")
                        + f" {most}"
                    )
                total += numel
        budget = self.per_element * everything + self.tensors_per_entry * len(params)
        if total > budget:
            return f"the state holds {total} elements, more than {budget}"
        return None


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A state tensor in a parsed header: the stream's ``index``-th tensor."""

    index: int


def _encode(value: Any, where: str, stream: list[tuple[str, torch.Tensor]] | None) -> Any:
    """``value`` as the header carries it ([Note: values in the state
    header]). A tensor goes into ``stream`` (the state's), or inline where
    ``stream`` is None (a hyperparameter). Raises ConfigError naming
    ``where`` for what cannot be sent."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise ConfigError(f"ElasticState cannot send {where}: a {value.layout} tensor")
        dtype = _dtype_name(value.dtype, where)
        if stream is not None:
            stream.append((f"optimizer:{where}", value.detach()))
            return {"stream": len(stream) - 1}
        if value.numel() > INLINE_NUMEL_MAX:
            raise ConfigError(
                f"ElasticState cannot send {where}: a tensor of {value.numel()} elements "
                f"(a hyperparameter may be one of at most {INLINE_NUMEL_MAX})"
            )
        return {"tensor": [dtype, list(value.shape), value.detach().cpu().reshape(-1).tolist()]}
    if type(value) is tuple or type(value) is list:
        items = [_encode(v, f"{where}[{i}]", stream) for i, v in enumerate(value)]
        return {type(value).__name__: items}
    if type(value) is dict and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, f"{where}[{k!r}]", stream) for k, v in value.items()}}
    raise ConfigError(
        f"ElasticState cannot send {where}: a {type(value).__name__} (it sends tensors, None, "
        "bool, int, float, str, and tuples, lists and str-keyed dicts of them)"
    )


def _decode(obj: Any, where: str, bad: _Sender, refs: list[int] | None, depth: int = 0) -> Any:
    """A value of a header as ``_encode`` wrote it; a state tensor as a
    _Ref, its index appended to ``refs`` (None: a hyperparameter, where
    none may be). Raises ProtocolError for anything else."""
    if depth > DEPTH_MAX:
        raise bad.malformed(f"{where} nests deeper than {DEPTH_MAX}")
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, dict) and len(obj) == 1:
        ((tag, body),) = obj.items()
        if tag in ("tuple", "list") and isinstance(body, list):
            items = [_decode(v, f"{where}[{i}]", bad, refs, depth + 1) for i, v in enumerate(body)]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict" and isinstance(body, dict):
            return {k: _decode(v, f"{where}[{k!r}]", bad, refs, depth + 1) for k, v in body.items()}
        if tag == "stream" and refs is not None and _is_int(body):
            refs.append(body)
            return _Ref(body)
        if tag == "tensor" and refs is None:
            return _inline_tensor(body, where, bad)
    raise bad.malformed(f"{where} is not a value ElasticState sends: {_brief(obj)}")


def _inline_tensor(body: Any, where: str, bad: _Sender) -> torch.Tensor:
    if not (isinstance(body, list) and len(body) == 3):
        raise bad.malformed(f"{where} is not a [dtype, shape, values] tensor")
    dtype, shape, values = body
    numel = _numel(shape, where, bad)
    if dtype not in _DTYPES or not isinstance(values, list) or len(values) != numel:
        raise bad.malformed(f"{where} is not a [dtype, shape, values] tensor: {_brief(body)}")
    if numel > INLINE_NUMEL_MAX or not all(isinstance(v, bool | int | float) for v in values):
        raise bad.malformed(f"{where} is not a small tensor of numbers: {_brief(body)}")
    try:
        return torch.tensor(values, dtype=_DTYPES[dtype]).reshape(shape)
    except (RuntimeError, OverflowError, TypeError, ValueError) as exc:
        raise bad.malformed(f"{where}: {exc}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _numel(shape: Any, where: str, bad: _Sender) -> int:
    if not (
        isinstance(shape, list) and len(shape) <= 64 and all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise bad.malformed(f"{where}'s shape is not a list of sizes: {_brief(shape)}")
    return math.prod(shape)


def _brief(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (all but its params), encoded:
    ConfigError names one that cannot be sent."""
    return [
        {k: _encode(v, f"param_groups[{i}][{k!r}]", None) for k, v in g.items() if k != "params"}
        for i, g in enumerate(groups)
    ]


def _outgoing(
    model: nn.Module, optimizer: torch.optim.Optimizer, limits: _Limits
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """Every tensor of the state in stream order, with its name, and the
    optimizer's part of the header (its state, tensors as references into
    the stream). Raises ConfigError for a state that cannot be sent."""
    named: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        named.append((f"param:{name}", p.detach()))
    for name, b in model.named_buffers():
        named.append((f"buffer:{name}", b.detach()))
    for name, t in named:
        _dtype_name(t.dtype, name)
    sd = optimizer.state_dict()
    params = [p.shape for g in optimizer.param_groups for p in g["params"]]
    state: dict[str, dict[str, Any]] = {}
    entries: dict[int, list[tuple[str, torch.Size]]] = {}
    for key, entry in sd["state"].items():
        first = len(named)
        out: dict[str, Any] = {}
        for field, value in entry.items():
            if not isinstance(field, str):
                raise ConfigError(f"ElasticState cannot send state[{key}]'s field {field!r}")
            out[field] = _encode(value, f"state[{key}][{field!r}]", named)
        state[str(key)] = out
        entries[int(key)] = [(n, t.shape) for n, t in named[first:]]
    exceeds = limits.error(entries, params)
    if exceeds is not None:
        raise ConfigError(f"ElasticState cannot send the optimizer's state: {exceeds}")
    groups = _hyperparameters(sd["param_groups"])
    for group, theirs in zip(groups, sd["param_groups"], strict=True):
        group["params"] = list(theirs["params"])
    return named, {"class": _class_name(optimizer), "param_groups": groups, "state": state}


# ----------------------------------------------------- a header, as received


@dataclasses.dataclass(frozen=True)
class _Sender:
    """Who sent a header, and who reads it: the errors that name them."""

    rank: int
    reader: int | None = None
    world_size: int | None = None
    address: str | None = None

    def malformed(self, what: str) -> ProtocolError:
        return ProtocolError(
            f"ElasticState: rank {self.rank} sent a malformed state header: {what}",
            rank=self.reader,
            world_size=self.world_size,
            peer=self.rank,
            peer_address=self.address,
            op="state transfer",
        )

    def differs(self, what: str) -> ConfigError:
        return ConfigError(
            f"ElasticState: {what}",
            rank=self.reader,
            world_size=self.world_size,
            op="state transfer",
        )


@dataclasses.dataclass(frozen=True)
class _Own:
    """What a joiner checks a header against: its model's tensors (name:
    dtype, shape), its optimizer's class and hyperparameters as built
    (encoded), its groups' sizes, each parameter's shape, its limits, and
    the tensors of its own state (a member that joins again has some)."""

    tensors: dict[str, tuple[torch.dtype, torch.Size]]
    optimizer_class: str
    configured: list[dict[str, Any]]
    group_sizes: list[int]
    params: list[torch.Size]
    limits: _Limits
    state: dict[int, dict[str, tuple[torch.dtype, torch.Size]]]


@dataclasses.dataclass(frozen=True)
class _Header:
    """A header, checked: the group's step and extra, the stream's tensors
    (the first ``model`` are the model's), the group's hyperparameters now,
    and its optimizer's state (tensors as _Ref)."""

    step: int
    extra: Any
    specs: list[tuple[str, torch.dtype, torch.Size]]
    model: int
    groups: list[dict[str, Any]]
    state: dict[int, dict[str, Any]]


def _check_length(n: int, sender: _Sender) -> int:
    if not 2 <= n <= HEADER_BYTES_MAX:
        raise sender.malformed(f"a header of {n} bytes (at most {HEADER_BYTES_MAX})")
    return n


def _read_header(raw: bytes, own: _Own, sender: _Sender) -> _Header:
    """Parse and check a state header ([Note: what a joiner accepts]).
    Allocates nothing beyond the parsed JSON.

    Raises:
        ProtocolError: the header is malformed (naming ``sender``).
        ConfigError: the group's model or optimizer differs from this
            process's, or the members refused to send their state.
    """
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise sender.malformed(f"not JSON: {_brief(str(exc))}") from None
    if not isinstance(header, dict):
        raise sender.malformed(f"not a JSON object: {_brief(header)}")
    if header.get("format") != FORMAT:
        raise sender.differs(
            f"the members sent state format {_brief(header.get('format'))}, this process "
            f"reads {FORMAT}: run the same ferrogrpc on every process"
        )
    refused = header.get("refused")
    if refused is not None:
        if not isinstance(refused, str):
            raise sender.malformed(f"a refusal that is not a string: {_brief(refused)}")
        raise sender.differs(f"the members cannot send their state: {refused}")
    step: Any = header.get("step")
    if not (_is_int(step) and step >= 0):
        raise sender.malformed(f"step {_brief(step)}")
    specs = _read_specs(header.get("tensors"), sender)
    model = _check_model(specs, own, sender)
    optimizer = header.get("optimizer")
    if not isinstance(optimizer, dict):
        raise sender.malformed(f"optimizer {_brief(optimizer)}")
    groups = _check_optimizer(optimizer, own, sender)
    state = _read_state(optimizer.get("state"), specs, model, own, sender)
    return _Header(step, header.get("extra"), specs, model, groups, state)


def _read_specs(tensors: Any, sender: _Sender) -> list[tuple[str, torch.dtype, torch.Size]]:
    if not isinstance(tensors, list):
        raise sender.malformed(f"tensors {_brief(tensors)}")
    specs: list[tuple[str, torch.dtype, torch.Size]] = []
    for i, entry in enumerate(tensors):
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[1] in _DTYPES
        ):
            raise sender.malformed(f"tensors[{i}] is not [name, dtype, shape]: {_brief(entry)}")
        _numel(entry[2], f"tensors[{i}]", sender)
        specs.append((entry[0], _DTYPES[entry[1]], torch.Size(entry[2])))
    if len({name for name, _, _ in specs}) != len(specs):
        raise sender.malformed("a tensor named twice")
    return specs


def _check_model(
    specs: list[tuple[str, torch.dtype, torch.Size]], own: _Own, sender: _Sender
) -> int:
    """The model's part of the stream (the first tensors) against this
    process's model; returns how many tensors it has."""
    model = _model_count([name for name, _, _ in specs])
    if any(name.startswith("optimizer:") for name, _, _ in specs[:model]):
        raise sender.malformed("the optimizer's tensors before the model's")
    theirs = {name for name, _, _ in specs[:model]}
    missing = sorted(set(own.tensors) - theirs)
    extra = sorted(theirs - set(own.tensors))
    if missing or extra:
        raise sender.differs(
            "this process's model differs from the group's: "
            + "; ".join(
                part
                for part in (
                    f"the group has no {', '.join(missing[:5])}" if missing else "",
                    f"this model has no {', '.join(extra[:5])}" if extra else "",
                )
                if part
            )
        )
    for name, dtype, shape in specs[:model]:
        mine = own.tensors[name]
        if mine != (dtype, shape):
            raise sender.differs(
                f"{name} is {mine[0]} {tuple(mine[1])} here and {dtype} {_shape(shape)} in the "
                "group"
            )
    return model


def _shape(shape: torch.Size) -> str:
    return _brief(tuple(shape))


def _check_optimizer(optimizer: dict[str, Any], own: _Own, sender: _Sender) -> list[dict[str, Any]]:
    """The group's optimizer against this process's: its class, its groups'
    sizes, its hyperparameters as built. Returns the group's hyperparameters
    now (decoded), which this process adopts."""

    def differs(what: str) -> ConfigError:
        return sender.differs(f"this process's optimizer differs from the group's: {what}")

    name = optimizer.get("class")
    if not isinstance(name, str):
        raise sender.malformed(f"optimizer class {_brief(name)}")
    if name != own.optimizer_class:
        here, there = own.optimizer_class.rsplit(".", 1)[-1], name.rsplit(".", 1)[-1]
        if here == there:
            here, there = own.optimizer_class, name
        raise differs(f"class {here} vs {there}")
    now, built = optimizer.get("param_groups"), optimizer.get("configured")
    if not (isinstance(now, list) and isinstance(built, list) and len(now) == len(built)):
        raise sender.malformed(f"param_groups {_brief(now)}, configured {_brief(built)}")
    sizes: list[int] = []
    for i, group in enumerate(now):
        params = group.get("params") if isinstance(group, dict) else None
        if not (isinstance(params, list) and all(_is_int(p) for p in params)):
            raise sender.malformed(f"param_groups[{i}] {_brief(group)}")
        sizes.append(len(params))
    if sizes != own.group_sizes:
        raise differs(f"parameter groups of sizes {own.group_sizes} vs {sizes}")
    for i, (mine, theirs) in enumerate(zip(own.configured, built, strict=True)):
        if not isinstance(theirs, dict):
            raise sender.malformed(f"configured[{i}] {_brief(theirs)}")
        difference = _first_difference(mine, theirs, f"param_groups[{i}]", sender)
        if difference is not None:
            raise differs(difference)
    return [
        {
            k: _decode(v, f"param_groups[{i}][{k!r}]", sender, None)
            for k, v in group.items()
            if k != "params"
        }
        for i, group in enumerate(now)
    ]


def _first_difference(
    mine: dict[str, Any], theirs: dict[str, Any], where: str, sender: _Sender
) -> str | None:
    """The first hyperparameter (encoded) in which one group differs from
    another: "where['key']: mine vs theirs"; None if none does."""
    for key in [*mine, *(k for k in theirs if k not in mine)]:
        at = f"{where}[{key!r}]"
        shown = [
            repr(_decode(side[key], at, sender, None)) if key in side else "none"
            for side in (mine, theirs)
        ]
        if key not in mine or key not in theirs or _canonical(mine[key]) != _canonical(theirs[key]):
            return f"{at}: {shown[0]} vs {shown[1]}"
    return None


def _canonical(encoded: Any) -> str:
    """An encoded value as one string: equal exactly when the values are
    (a float's repr is exact; 1 and 1.0 and True differ)."""
    return json.dumps(encoded, sort_keys=True)


def _read_state(
    state: Any,
    specs: list[tuple[str, torch.dtype, torch.Size]],
    model: int,
    own: _Own,
    sender: _Sender,
) -> dict[int, dict[str, Any]]:
    """The group's optimizer state, its tensors checked against this
    process's parameters and limits, and against its own state's."""
    if not isinstance(state, dict):
        raise sender.malformed(f"optimizer state {_brief(state)}")
    out: dict[int, dict[str, Any]] = {}
    entries: dict[int, list[tuple[str, torch.Size]]] = {}
    seen: set[int] = set()
    for key, entry in state.items():
        index = int(key) if key.isascii() and key.isdigit() and len(key) < 10 else -1
        if not 0 <= index < len(own.params) or index in out or not isinstance(entry, dict):
            raise sender.malformed(f"optimizer state entry {_brief(key)} (of {len(own.params)})")
        refs: list[int] = []
        out[index] = {
            f: _decode(v, f"state[{index}][{f!r}]", sender, refs) for f, v in entry.items()
        }
        for ref in refs:
            if not model <= ref < len(specs) or ref in seen:
                raise sender.malformed(f"state[{index}] refers to tensor {ref} (of {len(specs)})")
            seen.add(ref)
        entries[index] = [(specs[r][0], specs[r][2]) for r in refs]
    if len(seen) != len(specs) - model:
        raise sender.malformed(
            f"{len(specs) - model - len(seen)} of the optimizer's tensors unused"
        )
    exceeds = own.limits.error(entries, own.params)
    if exceeds is not None:
        raise sender.malformed(f"more optimizer state than this optimizer holds: {exceeds}")
    for index, fields in own.state.items():
        for field, (dtype, shape) in fields.items():
            theirs = out.get(index, {}).get(field)
            if isinstance(theirs, _Ref) and specs[theirs.index][1:] != (dtype, shape):
                _, their_dtype, their_shape = specs[theirs.index]
                raise sender.differs(
                    f"this process's optimizer differs from the group's: state[{index}]"
                    f"[{field!r}]: {dtype} {tuple(shape)} vs {their_dtype} {_shape(their_shape)}"
                )
    return out


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


def _resolve(value: Any, targets: list[torch.Tensor]) -> Any:
    """A decoded state value, its _Ref replaced by the tensors received."""
    if isinstance(value, _Ref):
        return targets[value.index]
    if type(value) is list:
        return [_resolve(v, targets) for v in value]
    if type(value) is tuple:
        return tuple(_resolve(v, targets) for v in value)
    if type(value) is dict:
        return {k: _resolve(v, targets) for k, v in value.items()}
    return value


# ------------------------------------------------------------- the stream


@dataclasses.dataclass
class _Receiving:
    """A joiner's receipt of the optimizer's part, still landing."""

    works: list[tuple[Work[Any], list[_Segment], torch.Tensor | None]]
    stamps: list[concurrent.futures.Future[float]]  # when each landed
    targets: list[torch.Tensor]
    header: _Header
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
            offset = 0
            for seg in packed:
                n = seg.hi - seg.lo
                _bytes(targets[seg.tensor])[seg.lo : seg.hi].copy_(staged[offset : offset + n])
                offset += n


def _stripes(total: int, members: int) -> list[tuple[int, int]]:
    """Byte ranges of the stream, one per member, 64-byte aligned."""
    step = -(-total // members)
    step = -(-step // 64) * 64
    return [(min(total, i * step), min(total, (i + 1) * step)) for i in range(members)]


def _messages(sizes: list[int], lo: int, hi: int) -> list[list[_Segment]]:
    """The messages of stripe [lo, hi) of the stream of tensors of ``sizes``
    bytes: a large segment travels alone (straight from and into its
    tensor), small neighbours are packed together; none exceeds
    MESSAGE_BYTES. Members and joiners compute the same list."""
    messages: list[list[_Segment]] = []
    packed: list[_Segment] = []
    packed_bytes = 0
    start = 0
    for index, size in enumerate(sizes):
        end = start + size
        a, b = max(lo, start), min(hi, end)
        if a < b:
            seg_lo, seg_hi = a - start, b - start
            if seg_hi - seg_lo >= PACK_BELOW:
                if packed:
                    messages.append(packed)
                    packed, packed_bytes = [], 0
                for cut in range(seg_lo, seg_hi, MESSAGE_BYTES):
                    messages.append([_Segment(index, cut, min(seg_hi, cut + MESSAGE_BYTES))])
            else:
                if packed_bytes + (seg_hi - seg_lo) > MESSAGE_BYTES:
                    messages.append(packed)
                    packed, packed_bytes = [], 0
                packed.append(_Segment(index, seg_lo, seg_hi))
                packed_bytes += seg_hi - seg_lo
        start = end
    if packed:
        messages.append(packed)
    return messages


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, as a flat uint8 view (``t`` contiguous, on the CPU)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


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
        if broadcast is None or not isinstance(inner, nn.Module):
            raise ConfigError("ElasticState needs the fg.DDP wrapper itself, not its module")
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
        self._configured = _hyperparameters(optimizer.param_groups)
        self._limits = _Limits.of(optimizer)
        for name, t in [*inner.named_parameters(), *inner.named_buffers()]:
            _encode(t, name, [])  # a dtype or layout it cannot send: ConfigError
        if backend.joining:
            # What it allocates once admitted, faulted in while it waits:
            # [Note: a warm heap for a joiner] (runtime/allocator.py). Per
            # parameter byte: its gradient, DDP's two buckets (the second is
            # filled by the second step), the optimizer's, and one more for
            # what the transfer passes through meanwhile (gRPC's buffers).
            warm_heap(
                sum(
                    p.numel() * p.element_size() * (4 + _moments_per_parameter(group, optimizer))
                    for group in optimizer.param_groups
                    for p in group["params"]
                    if p.device.type == "cpu"
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
            if not backend.joining and backend.membership.epoch == 1 and self.step == 0:
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
        _outgoing(self.model, self.optimizer, self._limits)

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
            named, optimizer = _outgoing(self.model, self.optimizer, self._limits)
            raw = self._header(named, optimizer) if rank == 0 else b""
        except ConfigError as exc:
            refusal = exc.message
            raw = json.dumps({"format": FORMAT, "refused": refusal}).encode()
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
        model = _model_count([name for name, _ in named])
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

    def _header(self, named: list[tuple[str, torch.Tensor]], optimizer: dict[str, Any]) -> bytes:
        """The state's header, as rank 0 sends it. ConfigError: it cannot."""
        header = {
            "format": FORMAT,
            "step": self._backend.step_index,
            "extra": self.extra,
            "tensors": [[name, _dtype_name(t.dtype, name), list(t.shape)] for name, t in named],
            "optimizer": {**optimizer, "configured": self._configured},
        }
        try:
            raw = json.dumps(header).encode()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the group's extra is not JSON-able: {exc}") from None
        if len(raw) > HEADER_BYTES_MAX:
            raise ConfigError(f"a state header of {len(raw)} bytes (at most {HEADER_BYTES_MAX})")
        return raw

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
        sender = _Sender(0, backend.rank, backend.world_size, members[0] if members else None)
        length = torch.zeros(1, dtype=torch.int64)
        backend.recv(length, 0, HEADER_TAG)
        try:
            body = torch.empty(_check_length(int(length.item()), sender), dtype=torch.uint8)
        except ProtocolError:
            self._leave()
            raise
        backend.recv(body, 0, HEADER_TAG)
        try:
            header = _read_header(bytes(body.numpy()), self._own(), sender)
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

    def _own(self) -> _Own:
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
        return _Own(
            tensors=tensors,
            optimizer_class=_class_name(self.optimizer),
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
        """Where each tensor of the stream (checked: _read_header) lands:
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

    def _load_optimizer(self, targets: list[torch.Tensor], header: _Header) -> None:
        """The optimizer's state from ``targets``; its settings as they are
        (received with the header, see receive_from_members)."""
        groups = self.optimizer.state_dict()["param_groups"]
        state = {key: _resolve(entry, targets) for key, entry in header.state.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    @staticmethod
    def _copy_into(
        t: torch.Tensor, name: str, index: dict[str, int], targets: list[torch.Tensor]
    ) -> None:
        source = targets[index[name]]
        if source is not t and source.data_ptr() != t.data_ptr():
            t.copy_(source)
