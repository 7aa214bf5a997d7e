"""A rank program for wrapper fault tests: two ranks train a step with DDP or
FSDP, then the victim (rank 1) SIGKILLs itself in the middle of the next
step's gradient sync, once some of its bytes have moved. Usage:
wrapper_faults.py ddp|fsdp.

The survivor prints one JSON line: the error its sync raised, how many bytes
it received during that failed sync, and every gradient that differs from
what it was before the call.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn

import ferrogrpc as fg

LAYERS = 4
WIDTH = 1024  # a 1024 x 1024 float32 weight: 4 MiB per layer
VICTIM = 1


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def data(rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))


def moved(backend: fg.Backend) -> int:
    """Bytes this rank has received: over gRPC, or from its host's shared
    segments."""
    stats = fg.testing.stats(backend)
    return stats.bytes_received + stats.bytes_local


def strike_after(backend: fg.Backend, nbytes: int) -> None:
    """SIGKILL this process once it has received ``nbytes`` more."""
    start = moved(backend)

    def strike() -> None:
        while moved(backend) - start < nbytes:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=strike, daemon=True).start()


def main() -> None:
    mode = sys.argv[1]
    backend = fg.init_backend(timeouts=fg.Timeouts(collective=60, idle=60, connect=60))
    rank, world = backend.rank, backend.world_size
    inner = model()
    layer_bytes = WIDTH * (WIDTH + 1) * 4
    wrapper: nn.Module
    if mode == "ddp":
        # One bucket per layer: bucket 0 is done when the victim dies in bucket 1.
        wrapper = fg.DDP(inner, backend, bucket_size_bytes=layer_bytes + 1024)
        assert len(wrapper.bucket_layout()) == LAYERS, wrapper.bucket_layout()
    else:
        wrapper = fg.FSDP(inner, backend)
    # A good step on both ranks.
    wrapper(data(rank)).pow(2).sum().backward()
    wrapper.sync_gradients()  # type: ignore[operator]
    # The next step: the victim dies 1.5 layers' worth of bytes into its sync
    # (an all_reduce at world 2 receives its whole bucket; a reduce-scatter
    # half the tensor). DDP's sync starts during backward, FSDP's after it
    # (its forward all-gathers first).
    per_layer = layer_bytes if mode == "ddp" else layer_bytes // world
    if mode == "ddp" and rank == VICTIM:
        strike_after(backend, per_layer * 3 // 2)
    if mode == "ddp":
        # Gradients as they are before the sync: this step's local ones (no
        # DDP hooks involved), from a plain copy of the model.
        reference = copy.deepcopy(inner)
        for p in reference.parameters():
            p.grad = None
        reference(data(rank + 10)).pow(2).sum().backward()
        before = {n: p.grad.clone() for n, p in reference.named_parameters()}  # type: ignore[union-attr]
        for p in inner.parameters():
            p.grad = None
        params = dict(inner.named_parameters())
    else:
        # The shards keep the first step's averaged gradients.
        params = {str(i): p for i, p in enumerate(wrapper.parameters())}
        before = {n: p.grad.clone() for n, p in params.items()}  # type: ignore[union-attr]
    loss = wrapper(data(rank + 10)).pow(2).sum()
    # From here on bytes are the sync's (DDP's buckets start during backward).
    received = moved(backend)
    loss.backward()
    if mode == "fsdp" and rank == VICTIM:
        strike_after(backend, per_layer * 3 // 2)
    try:
        wrapper.sync_gradients()  # type: ignore[operator]
    except fg.FerroGrpcError as exc:
        since = moved(backend) - received
        differ = [
            n for n, p in params.items() if p.grad is None or not torch.equal(p.grad, before[n])
        ]
        record = {
            "rank": rank,
            "type": type(exc).__name__,
            "peer": exc.peer,
            "message": str(exc),
            "moved": since,
            "grads": len(params),
            "differ": differ,
        }
        backend.close()
        print("RESULT " + json.dumps(record), flush=True)
        return
    print("RESULT " + json.dumps({"rank": rank, "type": "none"}), flush=True)


if __name__ == "__main__":
    main()
