"""A healthy rank that prints nothing itself: DDP steps, a few collectives,
close. The logs test checks that the library printed nothing either."""

from __future__ import annotations

import torch
from torch import nn

import ferrogrpc as fg


def main() -> None:
    backend = fg.init_backend()
    torch.manual_seed(0)
    model = fg.DDP(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)), backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step + backend.rank))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        model.sync_gradients()
        opt.step()
    backend.all_reduce(torch.ones(1 << 20))
    backend.barrier()
    backend.close()


if __name__ == "__main__":
    main()
