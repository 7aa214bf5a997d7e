"""A rank program for fault tests: every rank starts a 64 MiB all_reduce (or,
with FAULT_OP=all_to_all, an all_to_all of 16 MiB to each rank) and the
victim rank fails mid-collective. Usage: faults.py MODE VICTIM OUTDIR.

- kill: the victim SIGKILLs itself once its collective is under way.
- stop: the victim SIGSTOPs itself (the test SIGKILLs it afterwards).
Survivors print one JSON line describing the error they got, and then check
that the backend stays broken with the same cause and closes cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

import ferrogrpc as fg


def main() -> None:
    mode, victim, outdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    idle = float(os.environ.get("FAULT_IDLE", "60"))
    backend = fg.init_backend(timeouts=fg.Timeouts(collective=120, idle=idle, connect=60))
    rank = backend.rank
    t = torch.ones(16 << 20)  # 64 MiB float32
    backend.all_reduce(t)  # a full one first: every connection is up
    if os.environ.get("FAULT_OP") == "all_to_all":
        out = torch.empty_like(t)

        def collective() -> None:
            backend.all_to_all_single(out, t)
    else:

        def collective() -> None:
            backend.all_reduce(t)

    if rank == victim:
        stats = fg.testing.stats(backend)

        def moved() -> int:
            return stats.bytes_received + stats.bytes_local

        def strike() -> None:
            start = moved()
            while moved() - start < (8 << 20):
                time.sleep(0.001)
            with open(os.path.join(outdir, "fault_time"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)

        threading.Thread(target=strike, daemon=True).start()
    try:
        collective()
    except fg.FerroGrpcError as exc:
        caught = time.time()
        record = {
            "rank": rank,
            "type": type(exc).__name__,
            "message": str(exc),
            "peer": exc.peer,
            "peer_address": exc.peer_address,
            "op": exc.op,
            "seq": exc.seq,
            "time": caught,
        }
        try:
            backend.all_reduce(torch.ones(4))
        except fg.FerroGrpcError as later:
            record["later"] = type(later).__name__
            record["later_message"] = str(later)
            record["later_seconds"] = time.time() - caught
        before = _threads()
        backend.close()
        record["threads_before_close"] = before
        record["threads_after_close"] = _threads()
        print("RESULT " + json.dumps(record), flush=True)
        return
    print("RESULT " + json.dumps({"rank": rank, "type": "none"}), flush=True)


def _threads() -> int:
    """This process's threads, less one still unmapping a closed plane's
    segments: it ends on its own, a moment after close() ([Note: unmapping
    in the background])."""
    return sum(1 for t in threading.enumerate() if t.name != "ferrogrpc-unmap")


if __name__ == "__main__":
    main()
