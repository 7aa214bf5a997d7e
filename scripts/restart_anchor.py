"""What torch's own answer to a lost rank costs for a sharded model: a
``torchrun`` restart of every worker and a reload of the last DCP
checkpoint, for the model ``scripts/fsdp_elastic_overhead.py`` trains.

    python scripts/restart_anchor.py --params 25M --nproc 4 --repeats 3

Each repeat runs ``torchrun --standalone --max-restarts 1`` with ``--nproc``
workers training an MLP of ``--params`` parameters (square Linear layers,
each one an FSDP2 ``fully_shard`` unit, then the root) with Adam in float32
over gloo. Before step ``--ckpt-step`` every rank saves the model and
optimizer with ``torch.distributed.checkpoint``; before step ``--kill-step``
rank 1 SIGKILLs itself. torchrun tears the group down and starts every
worker again; the new workers form the group, build and shard the model,
load the checkpoint and run on to ``--steps``.

Printed, per repeat: the step time (the slowest rank's median before the
kill), the seconds the save took, the checkpoint's size on disk, and the
seconds from the kill until the new processes were spawned, until Python
ran this file, until torch was imported, until the process group formed,
until the model was sharded, until the reload (``get_state_dict``, DCP
``load``, ``set_state_dict``; its own seconds beside it) finished and until
the first step after it completed (each the latest rank), and the steps lost
(the work since the checkpoint, done again). Then the median and spread of
kill -> first step over the repeats, beside that plus the lost steps redone.

Needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (set here): with torchrun's
shared store the restarted workers' gloo group never forms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.time()  # before torch is imported: Python is up and reading this file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from client.common import parse_count  # noqa: E402

WIDTH = 1024


def spawned_at() -> float | None:
    """Wall time this process was created, from /proc (10 ms resolution), or None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22 of stat(5)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return time.time() - age


def worker() -> None:
    spawned = spawned_at()
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.fsdp import fully_shard

    imported = time.time()
    torch.set_num_threads(1)
    out = Path(os.environ["OUT_DIR"])
    ckpt = out / "ckpt"
    steps = int(os.environ["STEPS"])
    ckpt_step, kill_step = int(os.environ["CKPT_STEP"]), int(os.environ["KILL_STEP"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    layers = max(1, int(os.environ["PARAMS"]) // (WIDTH * WIDTH + WIDTH))

    dist.init_process_group("gloo")
    grouped = time.time()
    rank = dist.get_rank()
    log = (out / f"rank{rank}.attempt{attempt}.jsonl").open("a")

    def record(**fields: Any) -> None:
        log.write(json.dumps({"rank": rank, "attempt": attempt, **fields}) + "\n")
        log.flush()

    record(pid=os.getpid(), spawned=spawned, started=STARTED, imported=imported, grouped=grouped)

    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    record(built=time.time())

    first = 0
    if attempt > 0:
        began = time.perf_counter()
        model_sd, optim_sd = get_state_dict(net, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        load(state, checkpoint_id=str(ckpt))
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        record(loaded=time.time(), load_s=time.perf_counter() - began)
        first = ckpt_step

    x = torch.randn(8, WIDTH)
    times: list[float] = []
    for step in range(first, steps):
        if attempt == 0 and step == ckpt_step:
            began = time.perf_counter()
            model_sd, optim_sd = get_state_dict(net, opt)
            save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt))
            record(save_s=time.perf_counter() - began)
        if attempt == 0 and step == kill_step:
            warm = times[1:] or times
            record(step_s=statistics.median(warm), steps_timed=len(warm))
            if rank == 1:
                (out / "kill.json").write_text(json.dumps({"killed": time.time()}))
                log.close()
                os.kill(os.getpid(), signal.SIGKILL)
        began = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - began)
        if attempt > 0 and step == first:
            record(first_step=time.time())
    record(done=time.time())
    log.close()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "OUT_DIR": tmp,
            "PARAMS": str(args.params),
            "STEPS": str(args.steps),
            "CKPT_STEP": str(args.ckpt_step),
            "KILL_STEP": str(args.kill_step),
            # torchrun's agent keeps one TCPStore for every round and the restarted
            # workers' gloo rendezvous reads the dead round's addresses (connectFullMesh:
            # connection refused, or a hang; pytorch/pytorch#135712). The opt-out gives
            # each round its own store, hosted by the new rank 0.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", str(args.nproc), "--max-restarts", "1"),
            *(__file__, "--worker"),
        ]
        logfile = out / "torchrun.log"
        with logfile.open("wb") as sink:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
            )
            try:
                rc: int | None = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # torchrun stops its workers on SIGTERM
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rc = None
        if rc != 0:
            reap(out)
            tail = logfile.read_text(errors="replace")[-4000:]
            raise SystemExit(f"torchrun {'timed out' if rc is None else f'exited {rc}'}:\n{tail}")
        recs: dict[tuple[int, int], dict[str, Any]] = {}
        for path in out.glob("rank*.attempt*.jsonl"):
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                recs.setdefault((rec["attempt"], rec["rank"]), {}).update(rec)
        killed = json.loads((out / "kill.json").read_text())["killed"]
        size = sum(p.stat().st_size for p in (out / "ckpt").rglob("*") if p.is_file())
    before = [r for (a, _), r in recs.items() if a == 0]
    after = [r for (a, _), r in recs.items() if a == 1]
    if len(before) != args.nproc or len(after) != args.nproc:
        raise SystemExit(f"expected {args.nproc} ranks per attempt, got {sorted(recs)}")

    def since_kill(key: str) -> float:
        return float(max(r[key] for r in after) - killed)

    has_spawn = all(r["spawned"] is not None for r in after)
    return {
        "step": max(r["step_s"] for r in before),
        "save": max(r["save_s"] for r in before),
        "size": size,
        "spawn": since_kill("spawned") if has_spawn else float("nan"),
        "python": since_kill("started"),
        "torch": since_kill("imported"),
        "group": since_kill("grouped"),
        "built": since_kill("built"),
        "loaded": since_kill("loaded"),
        "load": max(r["load_s"] for r in after),
        "first": since_kill("first_step"),
    }


def reap(out: Path) -> None:
    """SIGKILL any worker of a failed run still alive (each sits in a session of its own)."""
    for path in out.glob("rank*.attempt*.jsonl"):
        for line in path.read_text().splitlines():
            pid = json.loads(line).get("pid")
            if pid is None:
                continue
            try:  # only ours: a pid may have been reused since
                environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
                ours = f"\0OUT_DIR={out}\0".encode() in environ
            except OSError:
                continue
            if ours:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}s (min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    if "--worker" in sys.argv:
        worker()
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=parse_count, default=25_000_000)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ckpt-step", type=int, default=4)
    parser.add_argument("--kill-step", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: rank 1 is the one killed")
    if not 0 <= args.ckpt_step < args.kill_step < args.steps:
        parser.error("need 0 <= --ckpt-step < --kill-step < --steps")
    layers = max(1, args.params // (WIDTH * WIDTH + WIDTH))
    params = layers * (WIDTH * WIDTH + WIDTH)
    state = 3 * params * 4  # parameters, Adam exp_avg and exp_avg_sq, float32
    lost = args.kill_step - args.ckpt_step
    print(
        f"{layers} layers, {params / 1e6:.1f}M parameters; state (params + exp_avg + "
        f"exp_avg_sq, fp32) {state / 2**20:.0f} MiB in all, {state / args.nproc / 2**20:.0f} "
        f"MiB per rank of {args.nproc}",
        flush=True,
    )
    runs = []
    for i in range(args.repeats):
        got = run(args)
        runs.append(got)
        print(
            f"run {i}: step {got['step']:.3f}s | save {got['save']:.2f}s, ckpt "
            f"{got['size'] / 2**20:.0f} MiB | from kill: spawned {got['spawn']:.2f}s, python "
            f"{got['python']:.2f}s, torch imported {got['torch']:.2f}s, group "
            f"{got['group']:.2f}s, sharded {got['built']:.2f}s, reloaded {got['loaded']:.2f}s "
            f"(load {got['load']:.2f}s), first step "
            f"{got['first']:.2f}s | steps lost {lost}",
            flush=True,
        )
    firsts = [r["first"] for r in runs]
    totals = [r["first"] + lost * r["step"] for r in runs]
    print(f"kill -> first step after restart: {spread(firsts)}")
    print(f"plus the {lost} lost steps redone: {spread(totals)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
