"""A rank program for the multi-host test: all_reduces of a known size, and
the bytes this rank's network namespace sent meanwhile (its interfaces'
tx_bytes: ``ip netns exec`` shows the namespace's own /sys/class/net).
Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch

import ferrogrpc as fg
from client.netlab import tx_bytes

NUMEL = 4 << 20  # 16 MiB of float32
ITERS = 4


def main() -> None:
    # Every byte as it is: this counts what the hierarchy sends, and
    # packed chunks of constant tensors would be a fraction of it.
    os.environ["FERROGRPC_PACK"] = "off"
    with fg.init_backend() as backend:
        rank, world = backend.rank, backend.world_size
        backend.all_reduce(torch.ones(NUMEL))  # every connection up
        backend.barrier()
        before = tx_bytes()
        ok = True
        for i in range(ITERS):
            t = torch.full((NUMEL,), float(rank + i))
            backend.all_reduce(t)
            ok = ok and bool(t.eq(float(sum(range(world)) + world * i)).all())
        backend.barrier()
        sent = tx_bytes() - before
        record = {
            "rank": rank,
            "world_size": world,
            "path": backend.data_path,
            "address": backend.address,
            "tx_bytes": sent,
            "payload_bytes": NUMEL * 4 * ITERS,
            "ok": ok,
        }
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Closed already: end now, without torch's exit-time destructors (0.7 s
    # of CPU a process, which the suite would pay hundreds of times).
    os._exit(0)
