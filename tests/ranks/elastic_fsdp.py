"""A rank program: elastic FSDP (units, Adam, float64), one JSON line per
completed step, as elastic_train.py's for DDP (whose model, data and
learning rates it shares).

Each line adds the digests of this rank's shards and of the copy it keeps
(``own``, ``copy``) and whose shard that copy is (``copy_of``): a copy must
be bitwise equal to its owner's shard after every step.

Environment: STEPS, WORLD, SLOW, PACE, OUT_DIR, END_FILE as elastic_train.py's;
KILLS: kills, comma-separated, each ``AT@RANK`` (AT: ``before`` the
forward, ``forward``: inside the last unit's forward, ``backward``: halfway
through backward): the i-th happens at the first step at which the file
``kill-i`` exists in OUT_DIR, on the process that has RANK then (it takes
the file, so only one process does).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch
from torch import nn

import ferrogrpc as fg
from ferrogrpc.elastic import state as elastic_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_train import BATCH, _ended, _take, data, lr_at, model


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _bytes(tensors: list[Any]) -> int:
    return sum(
        t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.dim()
    )


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    backend = fg.init_backend(elastic=True, min_world_size=int(os.environ.get("MIN_WORLD", "2")))
    net = model().double()
    fsdp = fg.FSDP(net, backend, units={nn.Linear})
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    # What ElasticState warms a joiner's heap for (allocator.warm_heap).
    warmed: list[int] = []
    warm = elastic_state.warm_heap
    elastic_state.warm_heap = lambda n: warmed.append(n) or warm(n)  # type: ignore[assignment]
    state = fg.ElasticState(fsdp, opt, extra={"tag": "elastic-fsdp"})
    elastic_state.warm_heap = warm
    print(
        json.dumps({"event": "start", "pid": os.getpid(), "warmed": warmed, "t": time.time()}),
        flush=True,
    )
    try:
        done = run(backend, fsdp, net, opt, state)
    except fg.FerroGrpcError as exc:
        print(
            json.dumps(
                {
                    "event": "error",
                    "type": type(exc).__name__,
                    "error": str(exc),
                    "lost": getattr(exc, "lost", None),
                    "shards": getattr(exc, "shards", None),
                    "t": time.time(),
                }
            ),
            flush=True,
        )
        backend.close()
        sys.exit(3)
    full = fsdp.full_state_dict()
    torch.save(
        {"params": [full[n].clone() for n, _ in net.named_parameters()], "step": done},
        os.path.join(out_dir, f"final-{os.getpid()}.pt"),
    )
    print(json.dumps({"event": "done", "rank": backend.rank}), flush=True)
    backend.close()


def run(backend: Any, fsdp: Any, net: nn.Module, opt: Any, state: Any) -> int:
    """The training loop; returns the steps the group completed."""
    steps = int(os.environ.get("STEPS", "40"))
    end_file = os.environ.get("END_FILE", "")
    world = int(os.environ.get("WORLD", "4"))
    slow = float(os.environ.get("SLOW", "0.2"))
    pace = float(os.environ.get("PACE", "0"))
    kills = [k.split("@") for k in os.environ.get("KILLS", "").split(",") if k]
    out_dir = os.environ["OUT_DIR"]
    last = net[-1]
    for step in state.steps(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = data(step)
        x, y = x.double(), y.double()
        rank, size = backend.rank, backend.world_size
        idx = list(range(rank, BATCH, size))
        kill_at = next(
            (
                at
                for i, (at, who) in enumerate(kills)
                if int(who) == rank and _take(os.path.join(out_dir, f"kill-{i}"))
            ),
            None,
        )
        if kill_at is not None:
            print(json.dumps({"event": "kill", "at": kill_at, "t": time.time()}), flush=True)
            if kill_at == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kill_at == "forward":
                last.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            else:
                net[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        opt.zero_grad()
        loss = nn.functional.mse_loss(fsdp(x[idx]), y[idx])
        loss.backward()
        fsdp.sync_gradients()
        opt.step()
        if all(p.grad is None for p in fsdp.parameters()):
            print(json.dumps({"event": "rerun", "step": step, "t": time.time()}), flush=True)
            continue
        shards = fsdp._elastic
        line = {
            "step": step,
            "idx": idx,
            "world": backend.world_size,
            "rank": backend.rank,
            "epoch": backend.membership.epoch,
            "loss": loss.item(),
            "own": _digest([p for p in fsdp.parameters()]),
            "copy": _digest(shards.copies) if shards.copies else None,
            "copy_of": shards.layout.copy_of(shards.rank),
            # The gradient shards' buffers: one, laid out as the hand-over
            # to the buddy sends it (nothing copied together there).
            # What it holds for its shards (a joiner's heap was warmed for
            # it): shard and copy, Adam's two moments each, the gradient,
            # and the copy's gradient while it lives (the size of a copy).
            "held": _bytes(
                [
                    *fsdp.parameters(),
                    *(t for p in fsdp.parameters() for t in opt.state.get(p, {}).values()),
                    *shards.copies,
                    *(t for st in shards.copy_state for t in st.values()),
                    *(p.grad for p in fsdp.parameters() if p.grad is not None),
                    *shards.copies,
                ]
            ),
            "grad_buffers": len(
                {
                    p.grad.untyped_storage().data_ptr()
                    for p in fsdp.parameters()
                    if p.grad is not None
                }
            ),
            "t": time.time(),
        }
        print(json.dumps(line), flush=True)
        time.sleep(slow if backend.world_size < world else pace)
        if _ended(end_file, step):
            return step + 1
    return int(state.step)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
