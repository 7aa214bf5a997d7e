"""DiLoCo's fragments: how the trainable parameters are cut (by bytes, at
element boundaries), when each fragment syncs, and a fragment's pieces of
the parameters with its outer state. Pure arithmetic and plain tensors:
no collective here (the sync itself is diloco.py's)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

# ------------------------------------------------------------- the pure part


def fragment_starts(numels: Sequence[int], itemsizes: Sequence[int], parts: int) -> list[int]:
    """Where each of ``parts`` contiguous, non-empty fragments starts, as an
    index into the trainable parameters' elements laid end to end (in
    order; ``numels`` and ``itemsizes`` per parameter): cut ``k`` falls at
    the element boundary nearest ``k / parts`` of the total bytes (the
    earlier on a tie), inside a parameter where that is nearest, kept far
    enough from the ends that every fragment holds at least one element."""
    total = sum(numels)
    total_bytes = sum(n * s for n, s in zip(numels, itemsizes, strict=True))
    starts = [0]
    for k in range(1, parts):
        target = total_bytes * k / parts
        first = at = 0  # the parameter's first element and first byte
        cut = total
        for n, s in zip(numels, itemsizes, strict=True):
            if at + n * s >= target:
                into = (target - at) / s
                whole = math.floor(into)
                cut = first + (whole if into - whole <= 0.5 else whole + 1)
                break
            first, at = first + n, at + n * s
        starts.append(min(max(cut, starts[-1] + 1), total - (parts - k)))
    return starts


def sync_offset(fragment: int, sync_every: int, fragments: int) -> int:
    """Fragment ``fragment`` starts its exchange after inner step ``t``
    (``t >= 1``) when ``t % sync_every == sync_offset(...)``."""
    return fragment * sync_every // fragments


def sync_delay(sync_every: int, fragments: int) -> int:
    """How many inner steps after its start an exchange is applied: 0 (at
    once, blocking) with one fragment, ``sync_every // fragments`` with more."""
    return 0 if fragments == 1 else sync_every // fragments


def fragment_starting(step: int, sync_every: int, fragments: int) -> int | None:
    """The fragment whose exchange starts after inner step ``step``, if any
    (the offsets are distinct when ``fragments <= sync_every``)."""
    if step < 1:
        return None
    for f in range(fragments):
        if (step - sync_offset(f, sync_every, fragments)) % sync_every == 0:
            return f
    return None


@dataclasses.dataclass
class Piece:
    """Elements ``lo:hi`` of a parameter (flat, in its own order), at
    ``offset`` in its fragment's flat tensors."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    offset: int

    def label(self) -> str:
        """The name, with the element range when it is not the whole."""
        whole = self.lo == 0 and self.hi == self.param.numel()
        return self.name if whole else f"{self.name}[{self.lo}:{self.hi}]"


@dataclasses.dataclass
class Fragment:
    """Contiguous parameter elements that sync together, with their outer
    state: the global parameters and the outer momentum, each one flat
    tensor."""

    pieces: list[Piece]
    global_params: torch.Tensor
    momentum: torch.Tensor

    def flatten(self) -> torch.Tensor:
        """This rank's current parameters, flat, in the global dtype."""
        out = torch.empty_like(self.global_params)
        for piece in self.pieces:
            end = piece.offset + piece.hi - piece.lo
            out[piece.offset : end].copy_(piece.param.detach().reshape(-1)[piece.lo : piece.hi])
        return out

    def write(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for piece in self.pieces:
                source = flat[piece.offset : piece.offset + piece.hi - piece.lo]
                p = piece.param.detach()
                if piece.lo == 0 and piece.hi == p.numel():
                    p.copy_(source.view(p.shape))
                elif p.is_contiguous():
                    p.view(-1)[piece.lo : piece.hi].copy_(source)
                else:  # (reshape would copy: write the whole through a copy)
                    whole = p.reshape(-1).clone()
                    whole[piece.lo : piece.hi].copy_(source)
                    p.copy_(whole.view(p.shape))


def make_fragment(named: list[tuple[str, nn.Parameter]], start: int, end: int) -> Fragment:
    """The fragment of elements ``start:end`` of the trainable parameters
    laid end to end (a parameter with no element goes with the elements
    after it, or with the last fragment)."""
    pieces: list[Piece] = []
    dtype = torch.float32
    first = numel = 0
    total = sum(p.numel() for _, p in named)
    for name, p in named:
        lo, hi = max(start - first, 0), min(end - first, p.numel())
        empty = p.numel() == 0 and (start <= first < end or first == end == total)
        if lo < hi or empty:
            pieces.append(Piece(name, p, lo, hi, numel))
            numel += hi - lo
            dtype = torch.promote_types(dtype, p.dtype)
        first += p.numel()
    device = pieces[0].param.device
    fragment = Fragment(
        pieces=pieces,
        global_params=torch.empty(numel, dtype=dtype, device=device),
        momentum=torch.zeros(numel, dtype=dtype, device=device),
    )
    fragment.global_params.copy_(fragment.flatten())
    return fragment


def parameters_in(layout: list[list[str]]) -> list[str]:
    """The parameter names of a fragment layout, in order, each once."""
    names: list[str] = []
    for fragment in layout:
        for label in fragment:
            name = str(label).split("[", 1)[0]
            if not names or names[-1] != name:
                names.append(name)
    return names
