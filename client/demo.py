"""``ferrogrpc demo``: the main job, on embedded defaults.

Starts N local ranks (2 by default) as separate processes that rendezvous
through env://, trains a small MLP first with ferrogrpc DDP and then with
FSDP on synthetic data, with a live progress bar. Then it checks that every
rank holds identical parameters, equal to single-process training on the
whole batch, prints a summary table and writes a PNG of the loss curves.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from client.forks import spawn_ranks

MODES = ("ddp", "fsdp")
TOLERANCE = 1e-6


def worker(args: argparse.Namespace) -> int:
    import torch

    import ferrogrpc as fg
    from client.train import train

    torch.set_num_threads(1)
    out_dir = Path(args.out_dir)
    with fg.init_backend() as backend:
        rank = backend.rank
        stats = fg.testing.stats(backend)

        def moved() -> int:
            # Over gRPC, what this rank sent; between ranks on one host,
            # what it read from the others' shared segments.
            return stats.bytes_sent + stats.bytes_local

        for mode in MODES:
            start = time.monotonic()
            sent0 = moved()

            def progress(
                step: int,
                loss: float,
                wrapper: Any,
                mode: str = mode,
                start: float = start,
                sent0: int = sent0,
            ) -> None:
                if rank == 0:
                    record = {
                        "mode": mode,
                        "step": step,
                        "loss": loss,
                        "t": time.monotonic() - start,
                        "bytes": moved() - sent0,
                    }
                    print("PROGRESS " + json.dumps(record), flush=True)

            wrapper, losses = train(
                backend, mode, args.steps, args.batch, args.lr, args.hidden, on_step=progress
            )
            backend.barrier()
            elapsed = time.monotonic() - start
            state = (
                wrapper.full_state_dict() if isinstance(wrapper, fg.FSDP) else wrapper.state_dict()
            )
            torch.save(
                {k: v.detach().clone() for k, v in state.items()}, out_dir / f"{mode}-rank{rank}.pt"
            )
            summary = {
                "mode": mode,
                "rank": rank,
                "seconds": elapsed,
                "bytes_sent": moved() - sent0,
                "losses": losses,
            }
            (out_dir / f"{mode}-rank{rank}.json").write_text(json.dumps(summary))
    return 0


class Progress:
    """A one-line live progress bar on a terminal; periodic lines otherwise."""

    def __init__(self, total: int, nproc: int) -> None:
        self.total = total
        self.nproc = nproc
        self.tty = sys.stdout.isatty()
        self.last_print = 0.0
        self.last_quarter = -1

    def update(self, record: dict[str, Any]) -> None:
        step = int(record["step"]) + 1
        t = max(float(record["t"]), 1e-9)
        rate = step / t
        mbps = float(record["bytes"]) / t / 1e6
        width = 30
        filled = int(width * step / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"{record['mode'].upper():>4} [{bar}] {step:>4}/{self.total}  "
            f"loss {record['loss']:.5f}  "
            f"{rate:6.1f} steps/s  comm {mbps:7.2f} MB/s per rank"
        )
        now = time.monotonic()
        if self.tty:
            if now - self.last_print > 0.05 or step == self.total:
                end = "\n" if step == self.total else ""
                print("\r" + line, end=end, flush=True)
                self.last_print = now
        else:
            quarter = 4 * step // self.total
            if quarter != self.last_quarter:
                self.last_quarter = quarter
                print(line, flush=True)


def single_process_reference(args: argparse.Namespace) -> tuple[dict[str, Any], list[float]]:
    from torch import nn

    from client.train import build_model, global_batch, make_optimizer

    model = build_model(args.hidden)
    opt = make_optimizer(model.parameters(), args.lr)
    losses = []
    for step in range(args.steps):
        x, y = global_batch(step, args.batch)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.item()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def plot(path: Path, curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    styles = {
        "single process": ("black", "-", 3.0),
        "DDP": ("tab:blue", "--", 1.8),
        "FSDP": ("tab:orange", ":", 1.8),
    }
    for name, losses in curves.items():
        color, style, width = styles.get(name, ("gray", "-", 1.0))
        ax.plot(
            range(1, len(losses) + 1),
            losses,
            label=name,
            color=color,
            linestyle=style,
            linewidth=width,
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE, whole batch)")
    ax.set_title("ferrogrpc demo: DDP and FSDP track single-process training")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch

    out_png = Path(args.plot).resolve()
    with tempfile.TemporaryDirectory(prefix="ferrogrpc-demo-") as tmp:
        cmd = [sys.executable, "-m", "client.demo", "--worker", "--out-dir", tmp]
        cmd += ["--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr)]
        cmd += ["--hidden", str(args.hidden)]
        print(
            f"ferrogrpc demo: {args.nproc} ranks on this machine, MLP hidden={args.hidden}, "
            f"global batch {args.batch}, {args.steps} steps each of DDP then FSDP "
            f"(Adam, lr {args.lr})",
            flush=True,
        )
        procs = spawn_ranks(args.nproc, cmd, OMP_NUM_THREADS="1")
        progress = Progress(args.steps, args.nproc)
        failure: list[str] = []

        def drain(rank: int, proc: Any) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("PROGRESS "):
                    progress.update(json.loads(line[len("PROGRESS ") :]))
                elif line.strip():
                    print(f"[rank {rank}] {line.rstrip()}", flush=True)

        threads = [
            threading.Thread(target=drain, args=(r, p), daemon=True) for r, p in enumerate(procs)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad or time.monotonic() > deadline:
                failure.append(
                    f"rank {bad[0][0]} exited {bad[0][1]}"
                    if bad
                    else f"timed out after {args.timeout}s"
                )
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=5)
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failure or bad:
            reason = failure[0] if failure else f"rank {bad[0][0]} exited {bad[0][1]}"
            print(f"ferrogrpc demo: FAILED: {reason}")
            return 1

        ref_state, ref_losses = single_process_reference(args)
        rows = []
        curves: dict[str, list[float]] = {"single process": ref_losses}
        all_ok = True
        for mode in MODES:
            states = [torch.load(Path(tmp) / f"{mode}-rank{r}.pt") for r in range(args.nproc)]
            infos = [
                json.loads((Path(tmp) / f"{mode}-rank{r}.json").read_text())
                for r in range(args.nproc)
            ]
            identical = all(
                torch.equal(states[0][k], states[r][k])
                for r in range(1, args.nproc)
                for k in states[0]
            )
            diff = max(float((states[0][k] - ref_state[k]).abs().max()) for k in ref_state)
            matches = diff <= TOLERANCE and list(states[0]) == list(ref_state)
            ok = identical and matches
            all_ok &= ok
            seconds = max(i["seconds"] for i in infos)
            moved = sum(i["bytes_sent"] for i in infos)
            per_rank_bw = moved / args.nproc / seconds / 1e9
            curves[mode.upper()] = infos[0]["losses"]
            rows.append(
                (
                    mode.upper(),
                    seconds,
                    args.steps / seconds,
                    moved,
                    per_rank_bw,
                    identical,
                    diff,
                    ok,
                )
            )

        print()
        header = (
            f"{'mode':<5} {'time s':>7} {'steps/s':>8} {'bytes moved':>12} {'busbw GB/s':>10} "
            f"{'ranks identical':>15} {'max |diff| vs 1 proc':>21} {'equivalent':>10}"
        )
        print(header)
        print("-" * len(header))
        for mode, seconds, rate, moved, bw, identical, diff, ok in rows:
            print(
                f"{mode:<5} {seconds:7.2f} {rate:8.1f} {moved / 1e6:9.2f} MB {bw:10.4f} "
                f"{'yes' if identical else 'NO':>15} {diff:21.2e} {'yes' if ok else 'NO':>10}"
            )
        print(
            "(bytes moved: what the ranks sent over gRPC or read from each other's shared "
            "memory; busbw: those bytes per rank per second of training; "
            f"equivalence tolerance {TOLERANCE:g})"
        )
        plot(out_png, curves)
        print(f"loss curves written to {out_png}")
        print(
            "ferrogrpc demo: "
            + ("equivalence check PASSED" if all_ok else "equivalence check FAILED")
        )
        return 0 if all_ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--elastic" in argv:
        from client.demo_elastic import main as elastic_main

        return elastic_main([a for a in argv if a != "--elastic"])
    parser = argparse.ArgumentParser(
        prog="ferrogrpc demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=48, help="global batch, split across ranks")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--plot", default="ferrogrpc-demo-loss.png", help="where to write the PNG")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="instead: an elastic group that loses a rank and admits a replacement "
        "(ferrogrpc demo --elastic --help)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
