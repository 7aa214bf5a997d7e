"""elastic_train.py's training (its model, data, learning rates and step
lines) as torchrun's own elastic model runs it: a fixed ferrogrpc group
(env://, through torchrun's agent store) that torchrun restarts whole on any
failure, resuming from the checkpoint rank 0 writes after every step. The
anchor that issue 58's elastic path is measured beside.

Environment: STEPS, PACE (seconds after each step), OUT_DIR (the
checkpoint), KILL_FILE and FILE_KILL_RANK (that rank SIGKILLs itself, before
its forward, in the first step at which it can take the file); DDP=gloo:
torch's own DDP over gloo instead of ferrogrpc's."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ferrogrpc as fg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_train as et


def main() -> None:
    steps = int(os.environ.get("STEPS", "40"))
    pace = float(os.environ.get("PACE", "0"))
    kill_file = os.environ.get("KILL_FILE", "")
    kill_rank = int(os.environ.get("FILE_KILL_RANK", "-1"))
    checkpoint = os.path.join(os.environ["OUT_DIR"], "checkpoint.pt")
    net = et.model()
    if os.environ.get("DDP") == "gloo":  # torch's own DDP over gloo
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp: Any = nn.parallel.DistributedDataParallel(net)
        sync, close = (lambda: None), dist.destroy_process_group
    else:  # ferrogrpc's, a fixed group (env://)
        backend = fg.init_backend()
        rank, world = backend.rank, backend.world_size
        ddp = fg.DDP(net, backend, bucket_size_bytes=2048)
        sync, close = ddp.sync_gradients, backend.close
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    start = 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"] + 1
    print(json.dumps({"event": "start", "pid": os.getpid(), "resumed": start, "t": time.time()}))
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = et.lr_at(step)
        if kill_file and rank == kill_rank and et._take(kill_file):
            print(json.dumps({"event": "kill", "t": time.time()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = et.data(step)
        idx = list(range(rank, et.BATCH, world))
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[idx]), y[idx])
        loss.backward()
        sync()
        opt.step()
        if rank == 0:
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}
            torch.save(state, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
        line = {"step": step, "idx": idx, "world": world, "rank": rank, "t": time.time()}
        print(json.dumps({**line, "params": et._digest(net)}), flush=True)
        if pace:
            time.sleep(pace)
    close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
