"""The state header's codec: what ``ElasticState`` sends a joiner ahead of
the stream, encoded by a member and parsed, as hostile, by the joiner.

A header names the stream's tensors (name, dtype, shape, in stream order),
the optimizer's class, its hyperparameters as built and as they are now,
and its state, its tensors as references into the stream; or it refuses
the joiner the state. Encoding raises ConfigError for what cannot be sent;
parsing checks the schema and every bound before anything is allocated.
Nothing here sends or receives: the stream and its transfer are state.py's.

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

import dataclasses
import json
import math
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, ProtocolError

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


def _dtype_name(dtype: torch.dtype, what: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"ElasticState: {what} has dtype {dtype}, which it cannot send")
    return name


def model_count(names: list[str]) -> int:
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
class Limits:
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
    def of(optimizer: torch.optim.Optimizer) -> Limits:
        if isinstance(optimizer, torch.optim.LBFGS):
            # d, prev_flat_grad, and two vectors a step of its history;
            # ro, al, H_diag and t are scalars.
            history = int(optimizer.param_groups[0]["history_size"])
            return Limits(False, True, 4 * history + 8, 2 * history + 2)
        shaped = isinstance(optimizer, _SHAPED)
        return Limits(shaped, False, TENSORS_PER_ENTRY, STATE_PER_ELEMENT)

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


def encode(value: Any, where: str, stream: list[tuple[str, torch.Tensor]] | None) -> Any:
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
        items = [encode(v, f"{where}[{i}]", stream) for i, v in enumerate(value)]
        return {type(value).__name__: items}
    if type(value) is dict and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode(v, f"{where}[{k!r}]", stream) for k, v in value.items()}}
    raise ConfigError(
        f"ElasticState cannot send {where}: a {type(value).__name__} (it sends tensors, None, "
        "bool, int, float, str, and tuples, lists and str-keyed dicts of them)"
    )


def _decode(obj: Any, where: str, bad: Sender, refs: list[int] | None, depth: int = 0) -> Any:
    """A value of a header as ``encode`` wrote it; a state tensor as a
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


def _inline_tensor(body: Any, where: str, bad: Sender) -> torch.Tensor:
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


def _numel(shape: Any, where: str, bad: Sender) -> int:
    if not (
        isinstance(shape, list) and len(shape) <= 64 and all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise bad.malformed(f"{where}'s shape is not a list of sizes: {_brief(shape)}")
    return math.prod(shape)


def _brief(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def class_name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (all but its params), encoded:
    ConfigError names one that cannot be sent."""
    return [
        {k: encode(v, f"param_groups[{i}][{k!r}]", None) for k, v in g.items() if k != "params"}
        for i, g in enumerate(groups)
    ]


def outgoing(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    limits: Limits,
    sharded: frozenset[int] = frozenset(),
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """Every tensor of the state in stream order, with its name, and the
    optimizer's part of the header (its state, tensors as references into
    the stream), less the state of ``sharded`` parameters (by id: an
    FSDP's shards, which move with their layout). Raises ConfigError for a
    state that cannot be sent."""
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
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    for key, entry in sd["state"].items():
        if id(flat[int(key)]) in sharded:
            continue
        first = len(named)
        out: dict[str, Any] = {}
        for field, value in entry.items():
            if not isinstance(field, str):
                raise ConfigError(f"ElasticState cannot send state[{key}]'s field {field!r}")
            out[field] = encode(value, f"state[{key}][{field!r}]", named)
        state[str(key)] = out
        entries[int(key)] = [(n, t.shape) for n, t in named[first:]]
    exceeds = limits.error(entries, params)
    if exceeds is not None:
        raise ConfigError(f"ElasticState cannot send the optimizer's state: {exceeds}")
    groups = hyperparameters(sd["param_groups"])
    for group, theirs in zip(groups, sd["param_groups"], strict=True):
        group["params"] = list(theirs["params"])
    return named, {"class": class_name(optimizer), "param_groups": groups, "state": state}


def encode_header(
    named: list[tuple[str, torch.Tensor]],
    optimizer: dict[str, Any],
    step: int,
    extra: Any,
    configured: list[dict[str, Any]],
) -> bytes:
    """The state's header, as rank 0 sends it: the stream's tensors
    (``named``, from ``outgoing``), the optimizer's part (``outgoing``'s),
    the group's step and extra, the hyperparameters as built. ConfigError:
    it cannot."""
    header = {
        "format": FORMAT,
        "step": step,
        "extra": extra,
        "tensors": [[name, _dtype_name(t.dtype, name), list(t.shape)] for name, t in named],
        "optimizer": {**optimizer, "configured": configured},
    }
    try:
        raw = json.dumps(header).encode()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the group's extra is not JSON-able: {exc}") from None
    if len(raw) > HEADER_BYTES_MAX:
        raise ConfigError(f"a state header of {len(raw)} bytes (at most {HEADER_BYTES_MAX})")
    return raw


def encode_refusal(reason: str) -> bytes:
    """A header that refuses the joiners the state, saying why."""
    return json.dumps({"format": FORMAT, "refused": reason}).encode()


# ----------------------------------------------------- a header, as received


@dataclasses.dataclass(frozen=True)
class Sender:
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
class Own:
    """What a joiner checks a header against: its model's tensors (name:
    dtype, shape), its optimizer's class and hyperparameters as built
    (encoded), its groups' sizes, each parameter's shape, its limits, and
    the tensors of its own state (a member that joins again has some)."""

    tensors: dict[str, tuple[torch.dtype, torch.Size]]
    optimizer_class: str
    configured: list[dict[str, Any]]
    group_sizes: list[int]
    params: list[torch.Size]
    limits: Limits
    state: dict[int, dict[str, tuple[torch.dtype, torch.Size]]]


@dataclasses.dataclass(frozen=True)
class Header:
    """A header, checked: the group's step and extra, the stream's tensors
    (the first ``model`` are the model's), the group's hyperparameters now,
    and its optimizer's state (tensors as _Ref)."""

    step: int
    extra: Any
    specs: list[tuple[str, torch.dtype, torch.Size]]
    model: int
    groups: list[dict[str, Any]]
    state: dict[int, dict[str, Any]]


def check_length(n: int, sender: Sender) -> int:
    if not 2 <= n <= HEADER_BYTES_MAX:
        raise sender.malformed(f"a header of {n} bytes (at most {HEADER_BYTES_MAX})")
    return n


def read_header(raw: bytes, own: Own, sender: Sender) -> Header:
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
    return Header(step, header.get("extra"), specs, model, groups, state)


def _read_specs(tensors: Any, sender: Sender) -> list[tuple[str, torch.dtype, torch.Size]]:
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


def _check_model(specs: list[tuple[str, torch.dtype, torch.Size]], own: Own, sender: Sender) -> int:
    """The model's part of the stream (the first tensors) against this
    process's model; returns how many tensors it has."""
    model = model_count([name for name, _, _ in specs])
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


def _check_optimizer(optimizer: dict[str, Any], own: Own, sender: Sender) -> list[dict[str, Any]]:
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
    mine: dict[str, Any], theirs: dict[str, Any], where: str, sender: Sender
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
    own: Own,
    sender: Sender,
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


def resolve(value: Any, targets: list[torch.Tensor]) -> Any:
    """A decoded state value, its _Ref replaced by the tensors received."""
    if isinstance(value, _Ref):
        return targets[value.index]
    if type(value) is list:
        return [resolve(v, targets) for v in value]
    if type(value) is tuple:
        return tuple(resolve(v, targets) for v in value)
    if type(value) is dict:
        return {k: resolve(v, targets) for k, v in value.items()}
    return value
