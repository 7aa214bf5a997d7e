"""Argument checks every collective runs on the caller's thread, before it
takes a sequence number: a bad call raises here and sends no data. (The
peer then still takes the collective's sequence number and tells the other
ranks that it refused the call, so that they fail it too instead of waiting:
see Peer._checks.)"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..algorithms.quantized import FORMATS
from ..errors import ConfigError, Identity
from ..ops import SUPPORTED_DTYPES, ReduceOp


def tensor(
    me: Identity,
    t: object,
    name: str,
    what: str = "tensor",
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
) -> torch.Tensor:
    """``t`` if it is a dense tensor of a supported dtype (``dtypes``: a
    point-to-point message, which nothing reduces, may be of any dtype the
    wire names)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        supported = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise me.error(
            ConfigError,
            f"{what} has unsupported dtype {t.dtype}; supported: {supported}",
            op=name,
        )
    if t.is_sparse:
        raise me.error(ConfigError, f"{what} is sparse; pass a dense tensor", op=name)
    if t.device.type not in ("cpu", "cuda"):
        raise me.error(
            ConfigError,
            f"{what} is on {t.device.type}, which is not supported; use cpu or cuda",
            op=name,
        )
    return t


def writable(me: Identity, t: torch.Tensor, name: str, what: str = "tensor") -> None:
    """``t`` receives a result in place: no two of its elements may share
    memory (an ``expand()``ed tensor, a stride-0 dimension, an
    ``as_strided`` view that overlaps itself)."""
    if _overlaps(t):
        raise me.error(
            ConfigError,
            f"{what} (shape {tuple(t.shape)}, stride {t.stride()}) has elements that share "
            "memory (an expand()ed or otherwise self-overlapping view), so it cannot hold a "
            "result; pass a tensor that owns its elements (e.g. .clone())",
            op=name,
        )


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory."""
    if t.is_contiguous():
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    if not dims or t.numel() == 0:
        return False
    if any(st == 0 for st, _ in dims):
        return True
    # Sorted by stride, each dimension stepping past everything the smaller
    # ones span is the usual (sufficient) proof of no overlap.
    span = 1
    for st, n in dims:
        if st < span:
            break
        span = st * n
    else:
        return False
    # An unusual layout: count the distinct offsets its elements occupy.
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    ordered = offsets.sort().values
    return bool((ordered[1:] == ordered[:-1]).any())


def coalesced(
    me: Identity, tensors: Sequence[object], op: ReduceOp | str, wire: object, name: str
) -> dict[tuple[str, str], list[int]]:
    """The indices of ``tensors`` by (dtype, device), if every one of them
    can be all-reduced in place with ``op`` and ``wire``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tensors):
        checked = tensor(me, t, name, f"tensors[{i}]")
        writable(me, checked, name, f"tensors[{i}]")
        reduce_op(me, op, checked, name)
        wire_dtype(me, wire, checked, name)
        groups.setdefault((str(checked.dtype), str(checked.device)), []).append(i)
    return groups


def reduce_op(me: Identity, op: object, t: torch.Tensor, name: str) -> ReduceOp:
    """``op`` as a ReduceOp, if it is defined for ``t``'s dtype."""
    try:
        rop = ReduceOp.coerce(op)
    except ConfigError as exc:
        raise me.error(ConfigError, exc.message, op=name) from None
    if rop is ReduceOp.MEAN and not t.is_floating_point():
        raise me.error(ConfigError, f"MEAN is not defined for integer dtype {t.dtype}", op=name)
    if rop.bitwise and t.is_floating_point():
        raise me.error(
            ConfigError, f"{rop.name} is defined for integer dtypes, not {t.dtype}", op=name
        )
    return rop


def root(me: Identity, r: object, name: str) -> int:
    """``r`` if it is a rank of the group."""
    if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < me.world_size:
        raise me.error(
            ConfigError, f"root must be a rank in [0, {me.world_size}), got {r!r}", op=name
        )
    return r


def same_dtype(me: Identity, out: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if out.dtype != t.dtype:
        raise me.error(ConfigError, f"out has dtype {out.dtype} but tensor has {t.dtype}", op=name)


def same_device(me: Identity, out: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if out.device != t.device:
        raise me.error(ConfigError, f"tensor is on {t.device} but out is on {out.device}", op=name)


def numel(me: Identity, what: str, has: int, formula: str, expected: int, name: str) -> None:
    """``what`` must have ``expected`` elements, as ``formula`` says."""
    if has != expected:
        raise me.error(
            ConfigError,
            f"{what} has {has} elements; expected {formula} = {expected}",
            op=name,
        )


WIRE_DTYPES = (torch.bfloat16, torch.float16)


def wire_dtype(me: Identity, wire: object, t: torch.Tensor, name: str) -> torch.dtype | None:
    """``wire`` if it narrows ``t``'s float dtype (bfloat16 or float16 for a
    float32 or float64 tensor); None for None or ``t``'s own dtype."""
    if wire is None or wire == t.dtype:
        return None
    if isinstance(wire, torch.dtype) and wire in FORMATS:
        raise me.error(
            ConfigError,
            f"wire_dtype={wire} is all_reduce's only (sum or mean), where each value is "
            f"rounded twice whatever the world size; {name} takes torch.bfloat16 or torch.float16",
            op=name,
        )
    if wire not in WIRE_DTYPES:
        raise me.error(
            ConfigError,
            "wire_dtype must be torch.bfloat16 or torch.float16 (or torch.int8 or torch.int4 "
            f"for all_reduce), got {wire!r}",
            op=name,
        )
    if t.dtype not in (torch.float32, torch.float64):
        raise me.error(
            ConfigError,
            f"wire_dtype={wire} narrows float32 and float64 tensors; this one is {t.dtype}",
            op=name,
        )
    assert isinstance(wire, torch.dtype)
    return wire


def splits(me: Identity, t: torch.Tensor, given: Sequence[int] | None, what: str) -> list[int]:
    """An all_to_all's ``given`` splits (rows of dim 0 per rank; None:
    equal) as element counts per rank."""
    world = me.world_size
    rows = t.shape[0] if t.dim() else t.numel()
    per_row = t.numel() // rows if rows else 0
    if given is None:
        if rows % world:
            raise me.error(
                ConfigError,
                f"{what}: {rows} rows do not split equally among {world} ranks",
                op="all_to_all",
            )
        return [rows // world * per_row] * world
    counts = list(given)
    if len(counts) != world or any(c < 0 for c in counts) or sum(counts) != rows:
        raise me.error(
            ConfigError,
            f"{what} must be {world} non-negative row counts summing to {rows}, got {counts}",
            op="all_to_all",
        )
    return [c * per_row for c in counts]


def all_to_all_splits(
    me: Identity,
    out: torch.Tensor,
    t: torch.Tensor,
    out_splits: Sequence[int] | None,
    in_splits: Sequence[int] | None,
    uniform: bool,
) -> tuple[list[int], list[int]]:
    """An all_to_all's splits (:func:`splits`), in and out, checked against
    each other: this rank's part to itself, and a ``uniform`` one's (no
    splits given)."""
    if uniform and (in_splits is not None or out_splits is not None):
        raise me.error(ConfigError, "a uniform all_to_all has equal splits", op="all_to_all")
    ins = splits(me, t, in_splits, "in_splits")
    outs = splits(me, out, out_splits, "out_splits")
    if ins[me.rank] != outs[me.rank]:
        raise me.error(
            ConfigError,
            f"this rank sends itself {ins[me.rank]} elements but expects {outs[me.rank]}",
            op="all_to_all",
        )
    return ins, outs


def peer(me: Identity, rank: object, name: str) -> int:
    """``rank`` if it is another rank of the group."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < me.world_size:
        raise me.error(
            ConfigError, f"peer must be a rank in [0, {me.world_size}), got {rank!r}", op=name
        )
    if rank == me.rank:
        raise me.error(ConfigError, "a rank cannot send to or receive from itself", op=name)
    return rank


def tag(me: Identity, value: object, name: str) -> None:
    if not isinstance(value, int) or not 0 <= value < 2**32:
        raise me.error(ConfigError, f"tag must be an int in [0, 2**32), got {value!r}", op=name)
