"""A rank program: elastic_train.py's model and data, in an elastic group,
with the optimizer OPTIM; one JSON line per completed step, as
elastic_train.py's.

OPTIM: ``adam`` (as elastic_train.py, its learning rate schedule too),
``sgd`` (momentum 0.9), ``adam-betas`` (Adam with betas (0.9, 0.99)),
``lbfgs`` (one iteration a step, history 4: its state is a flat vector over
every parameter and lists of tensors).
A process whose ElasticState refuses the group's state prints
``{"event": "refused", "error": ...}`` and exits 4.

Environment: STEPS, WORLD, SLOW, END_FILE (as elastic_train.py), OUT_DIR (the final
parameters, and LBFGS's history, go there).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import elastic_train
import torch
from torch import nn

import ferrogrpc as fg


def optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if kind == "adam-betas":
        return torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.99))
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if kind == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.05, max_iter=1, history_size=4)
    raise ValueError(kind)


def main() -> None:
    kind = os.environ["OPTIM"]
    steps = int(os.environ.get("STEPS", "20"))
    world = int(os.environ.get("WORLD", "3"))
    slow = float(os.environ.get("SLOW", "0.1"))
    backend = fg.init_backend(elastic=True, min_world_size=1)
    net = elastic_train.model()
    ddp = fg.DDP(net, backend)
    opt = optimizer(kind, ddp.parameters())
    state = fg.ElasticState(ddp, opt, extra={"tag": "elastic-optim"})
    print(json.dumps({"event": "start", "pid": os.getpid(), "t": time.time()}), flush=True)
    end_file = os.environ.get("END_FILE", "")
    done = None
    try:
        for step in state.steps(steps):
            if kind != "lbfgs":  # the schedule check_training's reference follows
                for group in opt.param_groups:
                    group["lr"] = elastic_train.lr_at(step)
            x, y = elastic_train.data(step)
            idx = list(range(backend.rank, elastic_train.BATCH, backend.world_size))

            def closure(x: torch.Tensor = x, y: torch.Tensor = y, idx: list[int] = idx) -> Any:
                opt.zero_grad()
                loss = nn.functional.mse_loss(ddp(x[idx]), y[idx])
                loss.backward()
                ddp.sync_gradients()
                return loss

            if kind == "lbfgs":
                loss = opt.step(closure)  # type: ignore[no-untyped-call]
            else:
                loss = closure()
                opt.step()
            if not any(p.grad is not None for p in net.parameters()):
                continue  # joined again inside the sync: the step is the group's
            line = {
                "step": step,
                "idx": idx,
                "world": backend.world_size,
                "rank": backend.rank,
                "epoch": backend.membership.epoch,
                "loss": float(loss),
                "t": time.time(),
            }
            print(json.dumps(line), flush=True)
            if backend.world_size < world:
                time.sleep(slow)
            if elastic_train._ended(end_file, step):
                done = step + 1
                break
    except fg.ConfigError as exc:
        print(json.dumps({"event": "refused", "error": str(exc)}), flush=True)
        backend.close()
        sys.exit(4)
    final: dict[str, Any] = {
        "params": [p.detach().clone() for p in net.parameters()],
        "step": state.step if done is None else done,
    }
    if kind == "lbfgs":
        final["old_dirs"] = [t.clone() for t in opt.state_dict()["state"][0]["old_dirs"]]
    torch.save(final, os.path.join(os.environ["OUT_DIR"], f"final-{os.getpid()}.pt"))
    print(json.dumps({"event": "done", "rank": backend.rank}), flush=True)
    backend.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
