"""A rank program for the flight-recorder test: DDP steps of a small model,
with FERROGRPC_FLIGHT_DIR set by the test. Usage: flight_stall.py VICTIM
STOP_STEP OUTDIR.

The victim SIGSTOPs itself at step STOP_STEP, before its forward: it never
calls that step's all-reduce, which the others wait in until their idle
timeout (1 s). The test then wakes it (SIGCONT): it calls the all-reduce late,
fails, and writes its own record too. Every rank prints one RESULT line,
and then waits for OUTDIR/release before it closes (so that the woken
victim still finds its peers' servers).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import common  # the script's folder is on sys.path
import torch
from torch import nn

import ferrogrpc as fg


def main() -> None:
    victim, stop_step, outdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    backend = fg.init_backend(timeouts=fg.Timeouts(collective=120, idle=1.0, connect=60))
    rank = backend.rank
    torch.manual_seed(0)
    model = fg.DDP(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)), backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record: dict[str, object] = {"rank": rank, "type": "none"}
    try:
        for step in range(stop_step + 3):
            if rank == victim and step == stop_step:
                (outdir / "stopped").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 10 + rank))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            model.sync_gradients()
            opt.step()
    except fg.FerroGrpcError as exc:
        record = {"rank": rank, "type": type(exc).__name__, "peer": exc.peer, "seq": exc.seq}
    # One write of the whole line: stderr shares the pipe, and a flight
    # record's log line once landed between a print's text and its newline.
    sys.stdout.write("RESULT " + json.dumps(record) + "\n")
    sys.stdout.flush()
    common.wait_for_release(outdir)
    backend.close()


if __name__ == "__main__":
    main()
