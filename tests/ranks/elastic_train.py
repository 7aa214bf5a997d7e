"""A rank program: DDP training in an elastic group (FERROGRPC_COORDINATOR,
elastic=True), one JSON line per completed step.

Every step trains on a fixed global batch (BATCH samples, the same on every
process); each member takes the slice ``rank::world_size`` it had when the
step began. A line says the step, the sample indices this process's gradient
came from, the world size after the sync, the loss, and whether a state
transfer was still in flight as the step began. At the end the
process saves its parameters and optimizer state to OUT_DIR.

Environment:
  STEPS: the steps to run; WORLD: the full group size (while the group is
  smaller, each step sleeps SLOW seconds, so that a joiner finds it running;
  otherwise PACE seconds, default 0). HOLD_FILE: after each step (and its
  sleep), wait while this file exists (a joiner then waits for the next
  boundary as long as the test needs). END_FILE: once it holds a step
  count, the run ends after that many steps instead of STEPS (read after
  every step, so it must leave every member a step to read it: the chaos
  harness and tests/test_elastic.py's Run.end_soon write it once, several
  steps ahead, with no joiner waiting).
  KILL_STEP, KILL_RANK, KILL_AT: rank KILL_RANK SIGKILLs itself at step
  KILL_STEP, ``before`` its forward or ``backward``, halfway through
  backward with the first buckets in flight.
  STOP_STEP, STOP_RANK: that rank SIGSTOPs itself at that step, before its
  sync (the test sends SIGCONT). STOP_AT=start: instead, once it is a member
  of the first epoch, before its first step (the members' start-up
  broadcast waits for it).
  KILL_FILE: rank FILE_KILL_RANK (default KILL_RANK) SIGKILLs itself, at
  FILE_KILL_AT (default before), in the first step at which this file
  exists; it removes the file first, so only one process does.
  MIN_WORLD: min_world_size; below it, the program prints the
  QuorumLostError and exits 3.
  PAD_MB: a parameter of that many MB more, all zeros, in the model and
  its loss times zero: it leaves the training as it is, and makes the
  state a joiner receives (with Adam's two moments) three times as large.
  TRANSFER_KILL_RANK, TRANSFER_KILL_FILE: that rank SIGKILLs itself as soon
  as it has posted the optimizer's part of the state to a joiner (the
  model's part sent), if it can take (remove) the file: one process only.
  BOUNDARY_KILL_STEP, BOUNDARY_KILL_RANK: that rank dies inside the
  boundary's one-element all-reduce after that step (gRPC links only:
  FERROGRPC_SHM=0, FERROGRPC_DIRECT=0). It sends its flag to one member
  (named in OUT_DIR/boundary-passer), then holds its loop until that
  member has passed the boundary (it touches OUT_DIR/boundary-passed as its
  next step begins), then SIGKILLs itself: that member stands in the next
  step's sync, the others at its boundary.
  OUT_DIR: where the final state goes.
  Each step's line also carries a digest of the parameters after it
  (``params``), which every contributor to that step must share.
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

BATCH = 12
IN, HIDDEN, OUT = 16, 32, 4


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def lr_at(step: int) -> float:
    """The learning rate of ``step``: it changes every step, so a joiner
    that ran its first step with any other (the group's of the step before)
    ends apart from the rest."""
    return 1e-2 * (0.5 + 0.25 * (step % 3))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    min_world = int(os.environ.get("MIN_WORLD", "2"))

    backend = fg.init_backend(elastic=True, min_world_size=min_world)
    net = model()
    pad_mb = int(os.environ.get("PAD_MB", "0"))
    if pad_mb:
        net.pad = nn.Parameter(torch.zeros(pad_mb * 2**18))
    # Small buckets: several are in flight during backward.
    ddp = fg.DDP(net, backend, bucket_size_bytes=2048)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    state = fg.ElasticState(ddp, opt, extra={"tag": "elastic-test"})
    if "TRANSFER_KILL_RANK" in os.environ:
        _die_sending(backend, int(os.environ["TRANSFER_KILL_RANK"]))
    if "BOUNDARY_KILL_STEP" in os.environ:
        _BOUNDARY["dir"] = out_dir
    start = {"event": "start", "pid": os.getpid(), "joining": backend.joining, "rank": backend.rank}
    print(json.dumps({**start, "t": time.time()}), flush=True)
    if os.environ.get("STOP_AT") == "start" and backend.rank == int(os.environ["STOP_RANK"]):
        print(json.dumps({"event": "stopping", "step": -1, "t": time.time()}), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        done = run(backend, ddp, net, opt, state, pad_mb)
    except fg.QuorumLostError as exc:
        print(
            json.dumps({"event": "quorum", "lost": exc.lost, "error": str(exc), "t": time.time()}),
            flush=True,
        )
        backend.close()
        sys.exit(3)
    torch.save(
        {
            "params": [p.detach().clone() for n, p in net.named_parameters() if n != "pad"],
            "step": done,
        },
        os.path.join(out_dir, f"final-{os.getpid()}.pt"),
    )
    print(json.dumps({"event": "done", "rank": backend.rank}), flush=True)
    backend.close()


def _die_sending(backend: Any, rank: int) -> None:
    """Rank ``rank`` SIGKILLs itself once its sends of the state to a
    joiner are posted (the optimizer's part still on its way)."""
    send = fg.ElasticState.send_to_joiners

    def send_then_die(self: Any, joined_from: int) -> None:
        send(self, joined_from)
        if backend.rank == rank and _take(os.environ["TRANSFER_KILL_FILE"]):
            print(json.dumps({"event": "kill", "sending": True, "t": time.time()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    fg.ElasticState.send_to_joiners = send_then_die  # type: ignore[method-assign]


# BOUNDARY_KILL_*: armed on the killed rank once its step is done.
_BOUNDARY: dict[str, Any] = {"armed": False, "sent": 0}


def _boundary_hook(dst: int, message: bytes) -> bytes:
    """Every transport's send hook: a no-op until armed; then the boundary
    flag (a one-element all-reduce) goes to one member, and this process
    waits for that member to pass the boundary before it dies."""
    if not _BOUNDARY["armed"]:
        return message
    from ferrogrpc.transport.wire import decode
    from ferrogrpc.v1 import collective_pb2 as pb

    header, payload = decode(message)
    if payload.nbytes != 4 or header.kind != pb.ALL_REDUCE:
        return message
    _BOUNDARY["sent"] += 1
    folder = _BOUNDARY["dir"]
    if _BOUNDARY["sent"] == 1:
        with open(os.path.join(folder, "boundary-passer.tmp"), "w") as f:
            f.write(str(dst))
        os.replace(
            os.path.join(folder, "boundary-passer.tmp"), os.path.join(folder, "boundary-passer")
        )
        return message
    # (This holds the loop: nothing more leaves this process.)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not os.path.exists(
        os.path.join(folder, "boundary-passed")
    ):
        time.sleep(0.01)
    print(json.dumps({"event": "kill", "boundary": True, "t": time.time()}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return message


if "BOUNDARY_KILL_STEP" in os.environ:
    from ferrogrpc.transport.grpc_streams import GrpcTransport

    _init = GrpcTransport.__init__

    def _hooked(self: GrpcTransport, *args: Any, **kwargs: Any) -> None:
        _init(self, *args, **kwargs)
        self.send_hook = _boundary_hook

    GrpcTransport.__init__ = _hooked  # type: ignore[method-assign]


def _passed_boundary(backend: Any, step: int) -> None:
    """The member the killed rank's flag reached: say so as its next step
    begins (it passed the boundary the others are stuck in)."""
    passer = os.path.join(_BOUNDARY["dir"], "boundary-passer")
    if step != int(os.environ["BOUNDARY_KILL_STEP"]) + 1 or not os.path.exists(passer):
        return
    with open(passer) as f:
        if int(f.read()) != backend.rank:
            return
    print(json.dumps({"event": "passed", "step": step, "rank": backend.rank}), flush=True)
    open(os.path.join(_BOUNDARY["dir"], "boundary-passed"), "w").close()


def _digest(net: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in net.named_parameters():
        if name != "pad":
            h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def _take(path: str) -> bool:
    """Whether this process removed ``path`` (exactly one can)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def write_end(path: str | os.PathLike[str], steps: int) -> None:
    """Make END_FILE say that the run ends after ``steps`` steps (written
    whole, then renamed: a rank never reads half of it)."""
    part = f"{os.fspath(path)}.part"
    with open(part, "w") as f:
        f.write(str(steps))
    os.replace(part, path)


def _ended(path: str, step: int) -> bool:
    """Whether END_FILE ``path`` (if any) ends the run with ``step``."""
    if not path:
        return False
    try:
        with open(path) as f:
            return step + 1 >= int(f.read())
    except (FileNotFoundError, ValueError):
        return False


def run(backend: Any, ddp: Any, net: Any, opt: Any, state: Any, pad_mb: int) -> int:
    """The training loop, with the faults the environment asks for; returns
    the steps the group completed."""
    steps = int(os.environ.get("STEPS", "40"))
    world = int(os.environ.get("WORLD", "4"))
    slow = float(os.environ.get("SLOW", "0.2"))
    kill_step = int(os.environ.get("KILL_STEP", "-1"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    kill_at = os.environ.get("KILL_AT", "before")
    stop_step = int(os.environ.get("STOP_STEP", "-1"))
    stop_rank = int(os.environ.get("STOP_RANK", "-1"))
    kill_file = os.environ.get("KILL_FILE", "")
    pace = float(os.environ.get("PACE", "0"))
    file_rank = int(os.environ.get("FILE_KILL_RANK", str(kill_rank)))
    file_at = os.environ.get("FILE_KILL_AT", "before")
    file_done = False
    boundary_step = int(os.environ.get("BOUNDARY_KILL_STEP", "-1"))
    boundary_rank = int(os.environ.get("BOUNDARY_KILL_RANK", "-1"))
    hold = os.environ.get("HOLD_FILE", "")
    end_file = os.environ.get("END_FILE", "")
    for step in state.steps(steps):
        if boundary_step >= 0:
            _passed_boundary(backend, step)
        # Whether the state's transfer (the optimizer's part) is still on
        # its way as the step begins: a joiner's first step and its
        # members' run beside it (see [Note: the state in two parts]).
        in_flight = state._receiving is not None or bool(state._sending)
        # What the group's last step left in ``extra``, as this step sees
        # it (a joiner's first step too), and this step's learning rate.
        extra_before = state.extra
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = data(step)
        rank, size = backend.rank, backend.world_size
        idx = list(range(rank, BATCH, size))
        if kill_file and rank == file_rank and not file_done and _take(kill_file):
            # A second kill, when the test says: rank FILE_KILL_RANK, at
            # FILE_KILL_AT (one process only: the one that took the file).
            kill_step, kill_rank, kill_at, file_done = step, file_rank, file_at, True
        if step == kill_step and rank == kill_rank:
            print(json.dumps({"event": "kill", "t": time.time()}), flush=True)
            if kill_at == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            # Halfway through backward: after the last layer's gradients
            # (their buckets start), before the first layer's.
            net[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[idx]), y[idx])
        if pad_mb:
            (loss + 0.0 * net.pad.sum()).backward()
        else:
            loss.backward()
        if step == stop_step and rank == stop_rank:
            print(json.dumps({"event": "stopping", "step": step}), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        ddp.sync_gradients()
        opt.step()
        if not any(p.grad is not None for p in net.parameters()):
            # This process stalled, was removed, and joined again inside
            # the sync: the step is the group's to finish, not ours.
            print(json.dumps({"event": "rejoined", "step": step}), flush=True)
            continue
        line = {
            "step": step,
            "idx": idx,
            "world": backend.world_size,
            "rank": backend.rank,
            "epoch": backend.membership.epoch,
            "loss": loss.item(),
            "extra": state.extra,
            "extra_before": extra_before,
            "in_flight": in_flight,
            "t": time.time(),
            # The parameters after this step: every contributor's must match.
            "params": _digest(net),
        }
        print(json.dumps(line), flush=True)
        state.extra = {"tag": "elastic-test", "last": step}
        if step == boundary_step and backend.rank == boundary_rank:
            _BOUNDARY["armed"] = True  # the next boundary's flag: see _boundary_hook
        if backend.world_size < world:
            time.sleep(slow)
        elif pace:
            time.sleep(pace)
        # (Last, just before the next boundary: a file made during the
        # sleep holds it too; a fast joiner was once admitted past it.)
        while hold and os.path.exists(hold):
            time.sleep(0.05)
        if _ended(end_file, step):
            return step + 1
    return int(state.step)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Closed already: end now, without torch's exit-time destructors (0.7 s
    # of CPU a process, which the suite would pay hundreds of times).
    os._exit(0)
