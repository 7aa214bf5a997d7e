"""``ferrogrpc demo --elastic [--fsdp]``: training that survives a lost rank.

Starts a coordinator and N local ranks (4 by default) in an elastic group,
trains the demo's MLP with DDP, SIGKILLs one rank a third of the way in,
then starts a replacement, which joins with live state. Afterwards it checks
that no step was lost, that every member held the same loss and parameters
at every step, and that the result equals single-process training on the
samples that contributed to each step (the kill step: the survivors'
slices only, unless the rank died after that step's sync was committed,
when its slice counts though it wrote no record: see :func:`contributors`).
It writes a PNG of the loss with the death and the join marked.

With ``--fsdp`` the ranks train with FSDP, every Linear a unit
(docs/elastic.md, "Elastic FSDP"): the lost rank's shards are re-laid over
the survivors from the copies their buddies keep, the step it died in runs
again over the survivors, and the replacement receives shards of its own.
No rank holds the whole model between steps, so the check is shard by
shard: at every step each member's slice loss and the sum of the shards it
holds equal single-process training's, every slice of the batch was
trained once, and at the end the whole model is the same on every member
and equal to single-process training's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.forks import Fork, popen

TOLERANCE = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Group:
    """A coordinator and rank processes (client.train --elastic), their
    JSON lines in files under ``tmp``."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        self.tmp = tmp
        self.port = _free_port()
        self.env = {
            **os.environ,
            "FERROGRPC_COORDINATOR": f"127.0.0.1:{self.port}",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.cmd = [sys.executable, "-m", "client.train", "--elastic", "--steps", str(args.steps)]
        self.cmd += ["--mode", "fsdp" if args.fsdp else "ddp"]
        self.cmd += ["--batch", str(args.batch), "--lr", str(args.lr)]
        self.cmd += ["--hidden", str(args.hidden), "--step-sleep", str(args.step_sleep)]
        self.procs: list[Fork | subprocess.Popen[bytes]] = []
        self.coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(args.nproc)),
                *("--host", "127.0.0.1", "--port", str(self.port)),
            ],
            env=self.env,
            stdout=open(tmp / "coordinator.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

    def start(self) -> Fork | subprocess.Popen[bytes]:
        """A rank process: a fork of client/forks.py's template."""
        n = len(self.procs)
        proc = popen(
            self.cmd,
            env=self.env,
            stdout=open(self.tmp / f"rank-process{n}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for n in range(len(self.procs)):
            text = (self.tmp / f"rank-process{n}.log").read_text(errors="replace")
            # Complete lines only: a running process may be writing the last.
            for line in text[: text.rfind("\n") + 1].splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    record["process"] = n
                    out.append(record)
        return out

    def close(self) -> None:
        for p in [*self.procs, self.coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()


def contributors(
    by_step: dict[int, list[dict[str, Any]]], victim: int
) -> dict[int, list[tuple[int, int]]] | str:
    """Each step's slices that reached its gradient, as (rank, world_size)
    when the step began; or why the records cannot say.

    A member's record is written after its step, so a member killed once
    its step's sync was committed (through the coordinator, by every
    member) contributed to the step but wrote no record of it. That shows:
    the group did not change during the step (the records' ``epoch`` is
    the one the step ``began`` in) and yet a slice of that world is
    missing. Only the killed process (``victim``) may be missing, and only
    at the step after its last record; a step whose group changed is the
    survivors' (DDP's sync redone with them, FSDP's step run again)."""
    last = max(
        (d["step"] for ds in by_step.values() for d in ds if d["process"] == victim), default=-1
    )
    its = [d for d in by_step.get(last, []) if d["process"] == victim]
    out: dict[int, list[tuple[int, int]]] = {}
    for step, ds in sorted(by_step.items()):
        parts = [(int(d["slice"][0]), int(d["slice"][1])) for d in ds]
        worlds = {w for _, w in parts}
        unchanged = all(d["epoch"] == d["began"] for d in ds)
        if unchanged and len(worlds) == 1:
            world = worlds.pop()
            missing = sorted(set(range(world)) - {r for r, _ in parts})
            if missing:
                # A rank keeps its number within an epoch: the victim's
                # rank is the one of its last record (same epoch).
                victims = [int(d["slice"][0]) for d in its if d["epoch"] == ds[0]["began"]]
                if step != last + 1 or missing != victims:
                    return f"step {step}: no record of ranks {missing} of {world}"
                parts += [(r, world) for r in missing]
        out[step] = sorted(parts)
    return out


def reference(args: argparse.Namespace, slices: dict[int, list[tuple[int, int]]]) -> list[float]:
    """Single-process training: each step's gradient is the mean over the
    slices that contributed (rank, world size at the step's start); returns
    the whole batch's loss after each step, as the ranks log it."""
    import torch
    from torch import nn

    from client.train import build_model, global_batch, make_optimizer

    model = build_model(args.hidden)
    opt = make_optimizer(model.parameters(), args.lr)
    losses = []
    for step in range(args.steps):
        x, y = global_batch(step, args.batch)
        opt.zero_grad()
        parts = slices[step]
        loss = sum(nn.functional.mse_loss(model(x[r::w]), y[r::w]) for r, w in parts) / len(parts)
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        with torch.no_grad():
            losses.append(float(nn.functional.mse_loss(model(x), y).item()))
    return losses


def plot(
    path: Path,
    members: list[float],
    ref: list[float],
    died: int,
    joined: int,
    fsdp: bool = False,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(range(len(ref)), ref, color="black", linewidth=3.0, label="single process")
    mode = "FSDP" if fsdp else "DDP"
    ax.plot(range(len(members)), members, "--", color="tab:blue", label=f"elastic group ({mode})")
    ax.axvline(died, color="tab:red", linestyle=":", label=f"rank killed (step {died})")
    ax.axvline(joined, color="tab:green", linestyle=":", label=f"joiner's first step ({joined})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    if fsdp:
        ax.set_ylabel("training loss (MSE, the step's slices, before it)")
    else:
        ax.set_ylabel("training loss (MSE, whole batch)")
    name = "ferrogrpc demo --elastic --fsdp" if fsdp else "ferrogrpc demo --elastic"
    ax.set_title(f"{name}: a rank lost, a replacement joins")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _name(args: argparse.Namespace) -> str:
    return "ferrogrpc demo --elastic --fsdp" if args.fsdp else "ferrogrpc demo --elastic"


def run(args: argparse.Namespace) -> int:
    out_png = Path(args.plot).resolve()
    mode = "FSDP (units: every Linear; every shard held twice)" if args.fsdp else "DDP"
    print(
        f"{_name(args)}: a coordinator and {args.nproc} ranks, {args.steps} {mode} "
        f"steps; one rank is killed at step {args.steps // 3}, then a replacement joins",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ferrogrpc-elastic-") as tmp:
        group = Group(Path(tmp), args)
        try:
            for _ in range(args.nproc):
                group.start()
            deadline = time.monotonic() + args.timeout
            kill_at = args.steps // 3
            victim = args.nproc - 1
            died_step = joined_step = -1
            t_kill = 0.0
            while time.monotonic() < deadline:
                # (Exits first: every line a process wrote before it exited is read.)
                done = [p.poll() for p in group.procs]
                lines = [d for d in group.lines() if "step" in d]
                if died_step < 0 and lines and max(d["step"] for d in lines) >= kill_at:
                    mine = [d for d in lines if d["process"] == victim]
                    died_step = max(d["step"] for d in lines) + 1
                    group.procs[victim].send_signal(signal.SIGKILL)
                    t_kill = time.monotonic()
                    print(f"  step {died_step}: killed rank {mine[-1]['rank']} (SIGKILL)")
                    group.procs[victim].wait()
                    group.start()
                    print("  started a replacement process")
                if died_step >= 0 and joined_step < 0:
                    theirs = [d for d in lines if d["process"] == args.nproc]
                    if theirs:
                        joined_step = theirs[0]["step"]
                        print(
                            f"  step {joined_step}: the replacement trains, as rank "
                            f"{theirs[0]['rank']} of {theirs[0]['world_size']} "
                            f"({time.monotonic() - t_kill:.1f}s after the kill)"
                        )
                if all(c is not None for c in done):
                    break
                bad = [c for i, c in enumerate(done) if c not in (None, 0) and i != victim]
                if bad:
                    break
                # The group finished without the replacement: nothing admits it now.
                if joined_step < 0 and all(c == 0 for c in done[: args.nproc - 1]):
                    break
                time.sleep(0.05)
            codes = [p.poll() for p in group.procs]
        finally:
            group.close()
        ok_codes = all(c == 0 for i, c in enumerate(codes) if i != victim)
        if not ok_codes or died_step < 0 or joined_step < 0:
            if died_step >= 0 and joined_step < 0:
                print(
                    f"{_name(args)}: the replacement was not admitted before the group "
                    f"finished its {args.steps} steps (it took longer to start than the steps "
                    "left): give it more --steps or a longer --step-sleep"
                )
            print(f"{_name(args)}: FAILED: exit codes {codes}")
            for n in range(len(group.procs)):
                print((Path(tmp) / f"rank-process{n}.log").read_text()[-2000:])
            return 1
        if args.fsdp:
            return check_fsdp(args, group.lines(), died_step, joined_step, out_png)
        return check(args, group.lines(), died_step, joined_step, out_png)


def check(
    args: argparse.Namespace,
    lines: list[dict[str, Any]],
    died: int,
    joined: int,
    out_png: Path,
) -> int:
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in lines:
        if "step" in d:
            by_step.setdefault(d["step"], []).append(d)
    kept = sorted(by_step) == list(range(args.steps))
    same = all(len({(d["loss"], d["checksum"]) for d in by_step.get(s, [])}) == 1 for s in by_step)
    if not kept:
        print(f"ferrogrpc demo --elastic: FAILED: steps kept: {sorted(by_step)}")
        return 1
    slices = contributors(by_step, args.nproc - 1)
    if isinstance(slices, str):
        print(f"ferrogrpc demo --elastic: FAILED: {slices}")
        return 1
    ref = reference(args, slices)
    members = [by_step[s][0]["loss"] for s in range(args.steps)]
    diff = max(abs(a - b) for a, b in zip(members, ref, strict=True))
    worlds = [by_step[s][0]["world_size"] for s in range(args.steps)]
    print()
    print(f"{'steps kept':<36} {args.steps} of {args.steps}" if kept else "steps lost")
    print(f"{'world size (start, after kill, end)':<36} {worlds[0]}, {worlds[died]}, {worlds[-1]}")
    print(f"{'members identical every step':<36} {'yes' if same else 'NO'}")
    print(f"{'max |loss diff| vs single process':<36} {diff:.2e} (tolerance {TOLERANCE:g})")
    ok = same and diff <= TOLERANCE
    plot(out_png, members, ref, died, joined)
    print(f"loss curve written to {out_png}")
    print("ferrogrpc demo --elastic: " + ("check PASSED" if ok else "check FAILED"))
    return 0 if ok else 1


@dataclass
class FsdpReference:
    """What single-process training gives for what FSDP members log: each
    (step, rank, world_size) slice's loss before the step and the sum of
    that rank's shards after it; the group's loss at each step (the mean
    over its slices); the sum of every parameter at the end."""

    slice_losses: dict[tuple[int, int, int], float]
    shard_sums: dict[tuple[int, int, int], float]
    losses: list[float]
    final: float


def reference_fsdp(
    args: argparse.Namespace, slices: dict[int, list[tuple[int, int]]]
) -> FsdpReference:
    """Single-process training as :func:`reference`'s, recording what an
    FSDP member logs. A rank's shards are FSDP's layout: each flattened
    parameter cut into world_size pieces of ceil(numel / world_size)
    elements, rank r holding the r-th (the last padded with zeros)."""
    from torch import nn

    from client.train import build_model, global_batch, make_optimizer

    model = build_model(args.hidden)
    opt = make_optimizer(model.parameters(), args.lr)
    out = FsdpReference({}, {}, [], 0.0)
    for step in range(args.steps):
        x, y = global_batch(step, args.batch)
        opt.zero_grad()
        parts = slices[step]
        losses = [nn.functional.mse_loss(model(x[r::w]), y[r::w]) for r, w in parts]
        (sum(losses) / len(parts)).backward()  # type: ignore[union-attr]
        opt.step()
        out.losses.append(sum(float(v.item()) for v in losses) / len(parts))
        flats = [p.detach().reshape(-1) for p in model.parameters()]
        for (r, w), loss in zip(parts, losses, strict=True):
            out.slice_losses[step, r, w] = float(loss.item())
            total = 0.0
            for flat in flats:
                n = -(-flat.numel() // w)
                total += float(flat[r * n : (r + 1) * n].sum().item())
            out.shard_sums[step, r, w] = total
    out.final = sum(float(p.detach().sum().item()) for p in model.parameters())
    return out


def check_fsdp(
    args: argparse.Namespace,
    lines: list[dict[str, Any]],
    died: int,
    joined: int,
    out_png: Path,
) -> int:
    """FSDP's check, shard by shard (see the module docstring)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in lines:
        if "step" in d:
            by_step.setdefault(d["step"], []).append(d)
    if sorted(by_step) != list(range(args.steps)):
        print(f"{_name(args)}: FAILED: steps kept: {sorted(by_step)}")
        return 1
    slices = contributors(by_step, args.nproc - 1)
    if isinstance(slices, str):
        print(f"{_name(args)}: FAILED: {slices}")
        return 1
    # Every slice of the batch once: the (rank, world_size) that reached
    # the step are exactly the world's, with no rank twice.
    whole = all(parts == [(r, len(parts)) for r in range(len(parts))] for parts in slices.values())
    if not whole:
        bad = next(
            s
            for s, parts in sorted(slices.items())
            if parts != [(r, len(parts)) for r in range(len(parts))]
        )
        print(f"{_name(args)}: FAILED: step {bad}'s slices are not the batch's, once each:")
        for d in by_step[bad]:
            print(f"  {d}")
        return 1
    ref = reference_fsdp(args, slices)

    def key(s: int, d: dict[str, Any]) -> tuple[int, int, int]:
        return s, int(d["slice"][0]), int(d["slice"][1])

    loss_diff = max(
        abs(d["slice_loss"] - ref.slice_losses[key(s, d)]) for s, ds in by_step.items() for d in ds
    )
    shard_diff = max(
        abs(d["shard_sum"] - ref.shard_sums[key(s, d)]) for s, ds in by_step.items() for d in ds
    )
    finals = [d["checksum"] for d in lines if d.get("event") == "done"]
    final_same = bool(finals) and len(set(finals)) == 1
    final_diff = abs(finals[0] - ref.final) if finals else float("inf")
    worlds = [len(slices[s]) for s in range(args.steps)]
    members = [
        sum(d["slice_loss"] for d in by_step[s]) / len(by_step[s]) for s in range(args.steps)
    ]
    rows = [
        ("steps kept", f"{args.steps} of {args.steps}"),
        ("world size (start, after kill, end)", f"{worlds[0]}, {worlds[died]}, {worlds[-1]}"),
        ("every slice trained once every step", "yes" if whole else "NO"),
        ("max |loss diff| vs single process", f"{loss_diff:.2e} (tolerance {TOLERANCE:g})"),
        ("max |shard sum diff| vs single process", f"{shard_diff:.2e}"),
        ("final model the same on every member", "yes" if final_same else "NO"),
        ("|final model sum diff| vs single process", f"{final_diff:.2e}"),
    ]
    print()
    for label, value in rows:
        print(f"{label:<40} {value}")
    ok = final_same and max(loss_diff, shard_diff, final_diff) <= TOLERANCE
    plot(out_png, members, ref.losses, died, joined, fsdp=True)
    print(f"loss curve written to {out_png}")
    print(f"{_name(args)}: " + ("check PASSED" if ok else "check FAILED"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ferrogrpc demo --elastic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--plot", default="ferrogrpc-elastic-loss.png")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="train with FSDP (units: every Linear), every shard held twice and re-sharded "
        "in memory when the group changes",
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
