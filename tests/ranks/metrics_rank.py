"""A rank program for the metrics port rule: joins with metrics on
(FERROGRPC_METRICS_PORT from the test), runs one all_reduce, prints READY,
and serves until OUTDIR/release appears. Usage: metrics_rank.py OUTDIR."""

from __future__ import annotations

import sys
from pathlib import Path

import common  # the script's folder is on sys.path
import torch

import ferrogrpc as fg


def main() -> None:
    outdir = Path(sys.argv[1])
    backend = fg.init_backend()
    backend.all_reduce(torch.ones(4))
    print("READY", flush=True)
    common.wait_for_release(outdir)
    backend.close()


if __name__ == "__main__":
    main()
