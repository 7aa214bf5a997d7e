"""A task with a real learning curve, for the slow-link benchmarks (issue
31): a character-level language model of ``data/python_reference.txt``.

The model reads ``CONTEXT`` characters (an embedding each, concatenated)
and predicts the next through an MLP; its loss is the cross-entropy in nats
per character. The last tenth of the text is held out: ``held_out_loss``
measures on it. Every rank draws its own batches from the first nine
tenths, from a generator seeded with its rank and the step, so a run is
reproducible and the ranks see different data.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

CORPUS = Path(__file__).parent / "data" / "python_reference.txt"
CONTEXT = 32
EMBED = 48
HIDDEN = 768


@functools.cache
def corpus() -> tuple[torch.Tensor, int]:
    """The text as character indices, and the vocabulary's size."""
    text = CORPUS.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.int64), len(vocab)


class CharMLP(nn.Module):
    """Next-character prediction from the last CONTEXT characters."""

    def __init__(self, vocab: int, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, EMBED)
        self.body = nn.Sequential(
            nn.Linear(CONTEXT * EMBED, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, vocab),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(self.embed(x).flatten(1))
        return out


def build(seed: int = 0, hidden: int = HIDDEN) -> CharMLP:
    """The model, the same on every rank for a seed."""
    _, vocab = corpus()
    torch.manual_seed(seed)
    return CharMLP(vocab, hidden)


def batch(rank: int, step: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of ``size`` windows at ``step``: inputs and the
    next characters. Another ``seed`` draws other batches."""
    data, _ = corpus()
    train_end = len(data) * 9 // 10
    gen = torch.Generator().manual_seed(1_000_003 * step + rank + 7_919 * seed)
    starts = torch.randint(0, train_end - CONTEXT - 1, (size,), generator=gen)
    offsets = torch.arange(CONTEXT)
    x = data[starts[:, None] + offsets]
    y = data[starts + CONTEXT]
    return x, y


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


@torch.no_grad()
def held_out_loss(model: nn.Module, windows: int = 4096) -> float:
    """The loss on ``windows`` evenly spaced windows of the held-out tenth."""
    data, _ = corpus()
    lo = len(data) * 9 // 10
    starts = torch.linspace(lo, len(data) - CONTEXT - 2, windows).long()
    x = data[starts[:, None] + torch.arange(CONTEXT)]
    y = data[starts + CONTEXT]
    return float(loss(model, x, y))
