"""``ferrogrpc demo --elastic``: training that survives a lost rank.

Starts a coordinator and N local ranks (4 by default) in an elastic group,
trains the demo's MLP with DDP, SIGKILLs one rank a third of the way in,
then starts a replacement, which joins with live state. Afterwards it checks
that no step was lost, that every member held the same loss and parameters
at every step, and that the result equals single-process training on the
samples that contributed to each step (the kill step: the survivors'
slices only). It writes a PNG of the loss with the death and the join
marked.
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
from pathlib import Path
from typing import Any

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
        self.cmd += ["--batch", str(args.batch), "--lr", str(args.lr)]
        self.cmd += ["--hidden", str(args.hidden), "--step-sleep", str(args.step_sleep)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(args.nproc)),
                *("--host", "127.0.0.1", "--port", str(self.port)),
            ],
            env=self.env,
            stdout=open(tmp / "coordinator.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

    def start(self) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        proc = subprocess.Popen(
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
            path = self.tmp / f"rank-process{n}.log"
            for line in path.read_text(errors="replace").splitlines():
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


def plot(path: Path, members: list[float], ref: list[float], died: int, joined: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(range(len(ref)), ref, color="black", linewidth=3.0, label="single process")
    ax.plot(range(len(members)), members, "--", color="tab:blue", label="elastic group (DDP)")
    ax.axvline(died, color="tab:red", linestyle=":", label=f"rank killed (step {died})")
    ax.axvline(joined, color="tab:green", linestyle=":", label=f"joiner's first step ({joined})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE, whole batch)")
    ax.set_title("ferrogrpc demo --elastic: a rank lost, a replacement joins")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    out_png = Path(args.plot).resolve()
    print(
        f"ferrogrpc demo --elastic: a coordinator and {args.nproc} ranks, {args.steps} DDP "
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
                lines = [d for d in group.lines() if "step" in d]
                done = [p.poll() for p in group.procs]
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
                time.sleep(0.05)
            codes = [p.poll() for p in group.procs]
        finally:
            group.close()
        ok_codes = all(c == 0 for i, c in enumerate(codes) if i != victim)
        if not ok_codes or died_step < 0 or joined_step < 0:
            print(f"ferrogrpc demo --elastic: FAILED: exit codes {codes}")
            for n in range(len(group.procs)):
                print((Path(tmp) / f"rank-process{n}.log").read_text()[-2000:])
            return 1
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
    slices = {s: [tuple(d["slice"]) for d in ds] for s, ds in by_step.items()}
    if not kept:
        print(f"ferrogrpc demo --elastic: FAILED: steps kept: {sorted(by_step)}")
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
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
