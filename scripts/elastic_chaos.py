"""Chaos for elastic DDP: kills, stalls, joins, starvation and coordinator
restarts, with every step checked.

A coordinator and ``--nproc`` processes of ``tests/ranks/elastic_train.py``
(DDP, Adam, one JSON line per step with a digest of the parameters) train
while seeded random events hit them. Then the invariants are checked:

- every step was completed exactly once: its contributors agree on the
  world size and end the step with the same parameters (digest);
- no hang: the group makes a step within ``--hang`` seconds of each event
  (after a stall, of its end), and the run ends;
- every process that was not killed exits 0 (no QuorumLostError, no
  RendezvousError), and the final models are bitwise equal;
- single-process replay: Adam on the slices that contributed to each step
  ends within 1e-6 of every final model.

    python scripts/elastic_chaos.py --seconds 180 --seed 7

``tests/test_restart.py`` runs a short, fixed sequence of the same events
through :func:`run` (``Chaos`` and ``check`` are importable).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RANK = ROOT / "tests" / "ranks" / "elastic_train.py"

# Events: what each does is in Chaos.apply.
KINDS = ("kill", "stall", "join", "restart", "restart_kill", "starve_kill_join")


@dataclasses.dataclass
class Event:
    kind: str
    delay: float  # seconds after the group's last progress
    outage: float = 0.0  # a restart: how long the coordinator is away
    stall: float = 0.0  # a stall or a starvation: how long


def plan(
    rng: random.Random, count: int, heartbeat: float, kinds: tuple[str, ...] = KINDS
) -> list[Event]:
    """``count`` events drawn from ``rng``."""
    events = []
    for _ in range(count):
        kind = rng.choice(kinds)
        events.append(
            Event(
                kind,
                delay=rng.uniform(0.5, 2.5),
                outage=rng.uniform(1.0, 4.0),
                stall=rng.uniform(0.3, 2.5 * heartbeat),
            )
        )
    return events


class Chaos:
    """The coordinator and the rank processes of one run, and the events."""

    def __init__(
        self,
        tmp: Path,
        nproc: int,
        steps: int,
        *,
        heartbeat: float = 2.0,
        pace: float = 0.05,
        min_world: int = 2,
        hang: float = 30.0,
        log: Any = print,
        spawn: Any = None,
    ) -> None:
        sys.path.insert(0, str(ROOT))
        from ferrogrpc.testing import free_port

        self.tmp = tmp
        self.nproc = nproc
        self.steps = steps
        self.heartbeat = heartbeat
        self.min_world = min_world
        self.hang = hang
        self.log = log
        # How a rank process starts: spawn(argv, env, output file) returning
        # what subprocess.Popen does (pid, poll, wait, kill), or None for a
        # new interpreter. (The tests start forks of a process that imported
        # torch already.)
        self.spawn = spawn
        self.port = free_port()
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "FERROGRPC_COORDINATOR": f"127.0.0.1:{self.port}",
            "FERROGRPC_HEARTBEAT_TIMEOUT": str(heartbeat),
            "OUT_DIR": str(tmp),
            "WORLD": str(nproc),
            "STEPS": str(steps),
            "SLOW": str(pace),
            "PACE": str(pace),
            "MIN_WORLD": str(min_world),
            "END_FILE": str(tmp / "end-step"),
        }
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.coordinators = 0
        self.procs: list[Any] = []
        self.killed: set[int] = set()
        self.problems: list[str] = []
        # Steps whose contributors' slices overlapped, and steps with a
        # contributor killed before it printed its line (see check).
        self.overlaps: list[int] = []
        self.silent_contributors: list[int] = []

    # ------------------------------------------------------------ processes

    def start_coordinator(self) -> None:
        out = (self.tmp / f"coordinator{self.coordinators}.log").open("wb")
        self.coordinators += 1
        self.coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(self.nproc)),
                *("--host", "127.0.0.1", "--port", str(self.port)),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def kill_coordinator(self) -> None:
        assert self.coordinator is not None
        self.coordinator.kill()
        self.coordinator.wait()

    def start_rank(self) -> int:
        n = len(self.procs)
        with (self.tmp / f"rank{n}.out").open("wb") as out:
            if self.spawn is not None:
                self.procs.append(self.spawn([str(RANK)], self.env, out))
            else:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(RANK)],
                        cwd=ROOT,
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        return n

    def kill_rank(self, n: int) -> None:
        self.killed.add(n)
        proc = self.procs[n]
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def members(self) -> list[int]:
        """The processes that are training (have made a step, not killed,
        not exited)."""
        stepped = {d["proc"] for d in self.lines() if "idx" in d}
        return [n for n in sorted(stepped) if self.procs[n].poll() is None]

    def lines(self, n: int | None = None) -> list[dict[str, Any]]:
        out = []
        for i in [n] if n is not None else range(len(self.procs)):
            path = self.tmp / f"rank{i}.out"
            text = path.read_text(errors="replace") if path.exists() else ""
            for line in text[: text.rfind("\n") + 1].splitlines():
                if line.startswith("{"):
                    try:
                        d = json.loads(line)
                    except ValueError:
                        continue
                    d["proc"] = i
                    out.append(d)
        return out

    def progress(self) -> int:
        return len({d["step"] for d in self.lines() if "idx" in d})

    def output(self, tail: int = 2500) -> str:
        parts = []
        for f in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("rank*.out")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for p in [*self.procs, self.coordinator]:
            if p is not None and p.poll() is None:
                with _Quiet():
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()

    # --------------------------------------------------------------- events

    def wait_progress(self, after: str, more: int = 3, limit: float | None = None) -> bool:
        """Whether the group makes ``more`` steps within ``limit`` (the hang
        limit)."""
        start = self.progress()
        limit = self.hang if limit is None else limit
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.progress() >= min(self.steps, start + more):
                return True
            if not self.members() and all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.1)
        self.problems.append(f"no step within {limit:g}s after {after} (at step {start})")
        return False

    def _victim(self, rng: random.Random, spare: int = 1) -> int | None:
        """A member that may go without the group losing its quorum."""
        members = self.members()
        if len(members) <= self.min_world + spare - 1:
            return None
        return rng.choice(members)

    def apply(self, event: Event, rng: random.Random) -> None:
        kind = event.kind
        self.log(f"[chaos] {kind} (outage {event.outage:.1f}s, stall {event.stall:.1f}s)")
        if kind == "kill":
            victim = self._victim(rng)
            if victim is not None:
                self.kill_rank(victim)
                time.sleep(rng.uniform(0.0, 1.0))
                self.start_rank()
        elif kind == "join":
            if len(self.members()) < self.nproc + 1:
                self.start_rank()
        elif kind == "stall":
            victim = self._victim(rng, spare=0)
            if victim is not None:
                before = self.progress()
                self._stop(victim, event.stall)
                if event.stall > self.heartbeat + 2.0 and self.progress() == before:
                    # Silent past the timeout: the others must have gone on.
                    self.problems.append(
                        f"a member stopped for {event.stall:.1f}s (heartbeat timeout "
                        f"{self.heartbeat:g}s) was not removed: no step meanwhile"
                    )
        elif kind == "restart":
            self.kill_coordinator()
            time.sleep(event.outage)
            self.start_coordinator()
            if self.wait_progress("a restart", more=5):
                log = (self.tmp / f"coordinator{self.coordinators - 1}.log").read_text()
                if "went silent" in log:
                    self.problems.append("the restarted coordinator removed live members as silent")
        elif kind == "restart_kill":
            # The coordinator is away while a member dies, and its
            # replacement is up before the coordinator is back.
            self.kill_coordinator()
            time.sleep(min(0.5, event.outage / 2))
            victim = self._victim(rng)
            if victim is not None:
                self.kill_rank(victim)
                self.start_rank()
            time.sleep(event.outage / 2)
            self.start_coordinator()
        elif kind == "starve_kill_join":
            # Issue 60: a member starved while a joiner waits, a member is
            # killed, a second one later, then two more joiners.
            self._starve_kill_join(event, rng)
        else:
            raise ValueError(f"unknown event {kind!r}")

    def _stop(self, n: int, seconds: float) -> None:
        proc = self.procs[n]
        with _Quiet():
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(seconds)
            os.kill(proc.pid, signal.SIGCONT)

    def _starve_kill_join(self, event: Event, rng: random.Random) -> None:
        starved = self._victim(rng, spare=0)
        if starved is None:
            return
        stop = threading.Event()

        def starve() -> None:
            # About 3% of a core: 0.03 s running in every 1.03 s... in short
            # bursts, so that its heartbeats come late but not never.
            proc = self.procs[starved]
            while not stop.is_set() and proc.poll() is None:
                with _Quiet():
                    os.kill(proc.pid, signal.SIGSTOP)
                stop.wait(0.4)
                with _Quiet():
                    os.kill(proc.pid, signal.SIGCONT)
                time.sleep(0.03)

        thread = threading.Thread(target=starve, daemon=True)
        thread.start()
        try:
            self.start_rank()
            time.sleep(rng.uniform(0.5, 1.5))
            others = [m for m in self.members() if m != starved]
            if len(others) + 1 > self.min_world + 1:
                self.kill_rank(rng.choice(others))
            time.sleep(rng.uniform(1.0, 3.5))
            others = [m for m in self.members() if m != starved]
            if len(others) + 1 > self.min_world + 1:
                self.kill_rank(rng.choice(others))
            self.start_rank()
            self.start_rank()
            time.sleep(max(0.0, event.stall * 3 - 2.0))
        finally:
            stop.set()
            thread.join()
            with _Quiet():
                os.kill(self.procs[starved].pid, signal.SIGCONT)

    def end_soon(self, ahead: int = 8) -> None:
        """Once every process not killed trains (no joiner waits), end the
        run ``ahead`` steps on instead of at ``steps``: the steps after the
        last event add nothing to the check. Every member reads the end
        after each step (elastic_train.py's END_FILE), and none is more
        than a step past the last one printed, so all end at the same
        step. If a process still waits after the hang limit, the run goes
        to ``steps``."""
        deadline = time.monotonic() + self.hang
        while time.monotonic() < deadline:
            alive = {n for n, p in enumerate(self.procs) if p.poll() is None}
            if alive and alive <= set(self.members()):
                end = self.progress() + ahead
                if end < self.steps:
                    _rank_program().write_end(self.env["END_FILE"], end)
                    self.steps = end
                    self.log(f"[chaos] the run ends after step {end - 1}")
                return
            time.sleep(0.1)

    def finish(self) -> list[int | None]:
        """Wait for every process to end (a hang is a problem)."""
        last, last_change = -1, time.monotonic()
        while any(p.poll() is None for p in self.procs):
            now = self.progress()
            if now != last:
                last, last_change = now, time.monotonic()
            elif time.monotonic() - last_change > self.hang:
                self.problems.append(f"hang: no step for {self.hang:g}s at step {now}")
                break
            time.sleep(0.2)
        return [p.poll() for p in self.procs]


class _Quiet:
    """Ignore a process that has gone (ProcessLookupError)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, *_: Any) -> bool:
        return kind is ProcessLookupError


def _rank_program() -> Any:
    """The rank program as a module: its model and data for the replay, and
    the END_FILE it reads."""
    if str(RANK.parent) not in sys.path:
        sys.path.insert(0, str(RANK.parent))
    import elastic_train

    return elastic_train


def check(chaos: Chaos, codes: list[int | None]) -> list[str]:
    """The invariants (see the module docstring); a list of violations."""
    elastic_train = _rank_program()
    import torch
    from elastic_train import BATCH
    from torch import nn

    problems = list(chaos.problems)
    for n, code in enumerate(codes):
        if n not in chaos.killed and code != 0:
            problems.append(f"process {n} exited {code}")
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in chaos.lines():
        if "idx" in d:
            by_step.setdefault(d["step"], []).append(d)
    missing = [s for s in range(chaos.steps) if s not in by_step]
    if missing:
        problems.append(f"steps never completed: {missing[:20]}")
    # The killed processes, by the last step each completed.
    last_step_killed: dict[int, list[int]] = {}
    for n in chaos.killed:
        done = [d["step"] for d in chaos.lines(n) if "idx" in d]
        last_step_killed.setdefault(max(done, default=-1), []).append(n)
    for step, lines in sorted(by_step.items()):
        procs = [d.get("proc") for d in lines]
        if len(set(procs)) != len(procs):
            problems.append(f"step {step} completed twice by one process: {procs}")
        worlds = {d["world"] for d in lines}
        if len(worlds) == 1 and len(lines) < next(iter(worlds)):
            # A member killed after its sync was committed, before it printed
            # its line: it contributed its slice (rank::world) to the step.
            world = next(iter(worlds))
            missing = sorted(set(range(world)) - {d["rank"] for d in lines})
            if len(missing) <= len(last_step_killed.get(step - 1, [])):
                chaos.silent_contributors.append(step)
                lines.extend(
                    {"idx": list(range(r, BATCH, world)), "world": world, "rank": r}
                    for r in missing
                )
        if worlds != {len(lines)}:
            problems.append(f"step {step}: {len(lines)} contributors, world sizes {sorted(worlds)}")
        seen: set[int] = set()
        for d in lines:
            if seen & set(d["idx"]):
                # Not a violation: each member trains on the slice it had as
                # the step began, and the world may change while it begins
                # (a boundary collective that some members finished and some
                # did not, members dying in it). The replay below counts the
                # slices that contributed, as DDP did.
                chaos.overlaps.append(step)
                break
            seen |= set(d["idx"])
        if len({d["params"] for d in lines if "params" in d}) != 1:
            problems.append(f"step {step}: members' parameters differ after it")
    if missing or any(p.startswith("step") for p in problems):
        return problems
    net = elastic_train.model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for step in range(chaos.steps):
        lines = by_step[step]
        x, y = elastic_train.data(step)
        for group in opt.param_groups:
            group["lr"] = elastic_train.lr_at(step)
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(net(x[d["idx"]]), y[d["idx"]]) for d in lines)
        (loss / len(lines)).backward()  # type: ignore[operator]
        opt.step()
    finals = [torch.load(f) for f in sorted(chaos.tmp.glob("final-*.pt"))]
    if not finals:
        problems.append("no process saved a final model")
    for final in finals:
        if final["step"] != chaos.steps:
            problems.append(f"a final model at step {final['step']}, not {chaos.steps}")
        for mine, first in zip(final["params"], finals[0]["params"], strict=True):
            if not torch.equal(mine, first):
                problems.append("final models differ")
                break
        worst = max(
            float((mine - ref.detach()).abs().max())
            for mine, ref in zip(final["params"], net.parameters(), strict=True)
        )
        if worst > 1e-6:
            problems.append(f"a final model is {worst:.2e} from single-process replay")
    return problems


def run(
    tmp: Path,
    events: list[Event],
    *,
    seed: int,
    nproc: int = 4,
    steps: int = 200,
    heartbeat: float = 2.0,
    pace: float = 0.05,
    hang: float = 30.0,
    log: Any = print,
    spawn: Any = None,
) -> tuple[Chaos, list[str]]:
    """Start a group, wait for its first steps, apply ``events`` in order
    (each after its delay, once the group made progress since the last),
    end the run a few steps after the last (:meth:`Chaos.end_soon`), and
    check. Returns the run and its violations. ``spawn``:
    as :class:`Chaos`'s."""
    rng = random.Random(seed)
    chaos = Chaos(
        tmp, nproc, steps, heartbeat=heartbeat, pace=pace, hang=hang, log=log, spawn=spawn
    )
    chaos.start_coordinator()
    for _ in range(nproc):
        chaos.start_rank()
    try:
        # (Processes that import torch on a loaded machine take a while.)
        if chaos.wait_progress("the start", more=5, limit=max(hang, 120.0)):
            for event in events:
                time.sleep(event.delay)
                if chaos.progress() >= chaos.steps - 5:
                    chaos.log("[chaos] the run is ending: no more events")
                    break
                chaos.apply(event, rng)
                if not chaos.wait_progress(event.kind):
                    break
            else:
                chaos.end_soon()
        codes = chaos.finish()
    finally:
        chaos.close()
    return chaos, check(chaos, codes)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=5)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds of sleep a step")
    parser.add_argument("--hang", type=float, default=30.0)
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    # About one event every 4-6 s, and steps for the whole time (a step
    # costs its pace and about as much again on two cores).
    count = max(1, int(args.seconds / 5))
    events = plan(rng, count, args.heartbeat)
    steps = int(args.seconds / (2.5 * args.pace))
    tmp = Path(tempfile.mkdtemp(prefix="ferrogrpc-chaos-"))
    began = time.monotonic()
    chaos, problems = run(
        tmp,
        events,
        seed=args.seed,
        nproc=args.nproc,
        steps=steps,
        heartbeat=args.heartbeat,
        pace=args.pace,
        hang=args.hang,
    )
    took = time.monotonic() - began
    lines = [d for d in chaos.lines() if "idx" in d]
    epochs = sorted({d["epoch"] for d in lines})
    print(
        f"seed {args.seed}: {len(events)} events ({', '.join(e.kind for e in events)}), "
        f"{chaos.progress()} of {steps} steps, {len(epochs)} epochs, "
        f"{len(chaos.procs)} processes ({len(chaos.killed)} killed), "
        f"{chaos.coordinators} coordinators, {took:.0f}s"
        + (f"; steps begun as the world changed: {chaos.overlaps}" if chaos.overlaps else "")
        + (
            f"; contributors killed before their line: steps {chaos.silent_contributors}"
            if chaos.silent_contributors
            else ""
        )
    )
    if problems:
        print(f"FAILED: {len(problems)} violations (logs in {tmp})")
        for p in problems[:30]:
            print("  " + p)
        return 1
    print("OK: 0 violations")
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
