"""A rank program for slow links: two all_reduces; before the second, the
late rank does rank-local work for LATE_S seconds (FERROGRPC's env:// and
timeouts from the environment). Prints one JSON line: the second call's
result or error, and how long it waited."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import ferrogrpc as fg


def main() -> int:
    late_rank, late_s = int(os.environ["LATE_RANK"]), float(os.environ["LATE_S"])
    armed = os.environ.get("ARM_FILE")
    with fg.init_backend() as backend:
        t = torch.ones(4)
        backend.all_reduce(t)  # warm: every connection is up
        if armed and backend.rank == late_rank:
            Path(armed).touch()  # the link starts losing SYNs now
        if backend.rank == late_rank:
            time.sleep(late_s)
        start = time.monotonic()
        record: dict[str, object] = {"rank": backend.rank}
        try:
            t = torch.full((4,), float(backend.rank + 1))
            backend.all_reduce(t)
            record["result"] = t.tolist()
        except fg.FerroGrpcError as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        record["waited"] = time.monotonic() - start
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
