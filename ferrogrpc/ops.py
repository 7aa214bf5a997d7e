"""Reduce ops and supported dtypes, and their wire codes."""

from __future__ import annotations

import enum

import torch

from .errors import ConfigError
from .v1 import collective_pb2 as pb


class ReduceOp(enum.Enum):
    """How all_reduce and reduce_scatter combine the ranks' values.

    The lowercase strings (``"sum"``, ``"mean"``, ``"max"``, ``"min"``,
    ``"product"``, ``"band"``, ``"bor"``, ``"bxor"``) and
    ``torch.distributed.ReduceOp`` (``AVG`` is ``MEAN``) are accepted
    wherever an op is taken. ``MEAN`` is defined for floating dtypes only:
    the sum is divided by ``world_size`` once, on the rank that finishes the
    segment, so every rank ends with bitwise identical values. The bitwise
    ops are defined for integer dtypes only.
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def coerce(cls, op: object) -> ReduceOp:
        """The op that ``op`` names: a ReduceOp, one of the lowercase
        strings, or a ``torch.distributed.ReduceOp`` (``AVG`` is ``MEAN``).

        Raises:
            ConfigError: ``op`` names no op here (``PREMUL_SUM`` among them).
        """
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        # torch.distributed.ReduceOp (and its RedOpType members), by name.
        inner = getattr(op, "op", None)
        if inner is not None and type(op).__module__.startswith("torch"):
            op = inner  # a ReduceOp object: its RedOpType
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        if type(op).__module__.startswith("torch") and isinstance(name, str):
            name = "mean" if name.upper() == "AVG" else name.lower()
            try:
                return cls(name)
            except ValueError:
                pass
        raise ConfigError(
            f"unknown reduce op {op!r}; expected one of "
            + ", ".join(repr(o.value) for o in cls)
            + ", a ReduceOp or a torch.distributed.ReduceOp (not PREMUL_SUM)"
        )

    @property
    def bitwise(self) -> bool:
        """Whether the op is ``BAND``, ``BOR`` or ``BXOR`` (integer dtypes only)."""
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


# torch.int4 (torch >= 2.5) is missing from torch's type stubs. It names a
# wire dtype of all_reduce only (algorithms/quantized.py): no tensor of it
# is made.
INT4: torch.dtype = torch.int4  # type: ignore[attr-defined]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bool,
)
"""The tensor dtypes every collective takes (the wire dtypes of compressed
collectives are another matter: ``wire_dtype``)."""

DTYPE_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
    torch.uint8: pb.UINT8,
    torch.int8: pb.INT8,
    torch.int16: pb.INT16,
    torch.bool: pb.BOOL,
}
WIRE_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_WIRE.items()}

OP_TO_WIRE: dict[ReduceOp, int] = {
    ReduceOp.SUM: pb.SUM,
    ReduceOp.MEAN: pb.MEAN,
    ReduceOp.MAX: pb.MAX,
    ReduceOp.MIN: pb.MIN,
    ReduceOp.PRODUCT: pb.PRODUCT,
    ReduceOp.BAND: pb.BAND,
    ReduceOp.BOR: pb.BOR,
    ReduceOp.BXOR: pb.BXOR,
}
WIRE_TO_OP: dict[int, ReduceOp] = {v: k for k, v in OP_TO_WIRE.items()}


def wire_dtype_name(code: int) -> str:
    dtype = WIRE_TO_DTYPE.get(code)
    return str(dtype).removeprefix("torch.") if dtype is not None else f"<dtype {code}>"


def wire_op_name(code: int) -> str:
    op = WIRE_TO_OP.get(code)
    return op.value if op is not None else "none"


def kind_name(code: int) -> str:
    try:
        return pb.CollectiveKind.Name(code).lower()
    except ValueError:
        return f"<kind {code}>"
