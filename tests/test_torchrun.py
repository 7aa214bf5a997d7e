"""Elastic training under torchrun (issue 58): real agents with
``--rdzv-backend=ferrogrpc`` on loopback "nodes" (``--local-addr``
127.0.0.x), each starting elastic_train.py workers, with a coordinator
beside them. A worker's death restarts its own node's workers only; a
node's death leaves the others training; a new node joins without a
restart anywhere (see [Note: two restart rules] in control/torchrun.py);
below the minimum, torchrun exits non-zero."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from .helpers import RANKS, ROOT, clean_env, free_port
from .test_elastic import check_training, elastic_train

HEARTBEAT_S = 2.0


class Node:
    """One torchrun agent and the workers it starts, their output in
    ``--log-dir`` (one file per worker and attempt)."""

    def __init__(self, job: TorchrunJob, name: str, addr: str, nproc: int) -> None:
        self.name = name
        self.logs = job.tmp / f"logs-{name}"
        self.out = open(job.tmp / f"agent-{name}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run"),
                f"--nnodes={job.nnodes}",
                f"--nproc-per-node={nproc}",
                f"--max-restarts={job.max_restarts}",
                *(f"--rdzv-backend={job.rdzv}", f"--rdzv-endpoint=127.0.0.1:{job.port}"),
                *("--rdzv-id=issue58", f"--local-addr={addr}", "--monitor-interval=0.1"),
                *(f"--log-dir={self.logs}", "--redirects=3"),
                str(job.script),
            ],
            # Not the checkout: a stale ferrogrpc.egg-info there would hide
            # the installed entry point from torch's registry.
            cwd=job.tmp,
            env=job.env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
        )

    def files(self) -> dict[tuple[int, int], Path]:
        """(attempt, local rank) -> that worker's stdout."""
        found = {}
        for path in self.logs.glob("*/attempt_*/*/stdout.log"):
            attempt = int(path.parent.parent.name.removeprefix("attempt_"))
            found[(attempt, int(path.parent.name))] = path
        return found

    def attempts(self) -> set[int]:
        return {attempt for attempt, _ in self.files()}

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for (attempt, local), path in sorted(self.files().items()):
            try:
                text = path.read_text(errors="replace")
            except FileNotFoundError:
                # A node restarted with its restart count still 0 removes its
                # attempt_0 and writes it again (the anchor test): between
                # the listing and the read, the file may be gone.
                continue
            for line in text[: text.rfind("\n") + 1].splitlines():  # complete lines only
                if line.startswith("{"):
                    d = json.loads(line)
                    d.update(node=self.name, attempt=attempt, local=local)
                    d["proc"] = f"{self.name}/{attempt}/{local}"
                    out.append(d)
        return out

    def pids(self, attempt: int) -> list[int]:
        return [
            d["pid"] for d in self.lines() if d.get("event") == "start" and d["attempt"] == attempt
        ]

    def kill(self) -> None:
        """SIGKILL the agent and every worker it started."""
        pids = [d["pid"] for d in self.lines() if d.get("event") == "start"]
        for pid in [self.proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


class TorchrunJob:
    """A coordinator and torchrun agents (``Node``) running ``script``;
    what check_training reads: ``tmp``, ``lines()``, ``output()``."""

    def __init__(
        self,
        tmp: Path,
        *,
        world_size: int,
        nnodes: str,
        script: Path = RANKS / "elastic_train.py",
        max_restarts: int = 5,
        rdzv: str = "ferrogrpc",
        **env: str,
    ) -> None:
        self.tmp = tmp
        self.rdzv = rdzv
        self.nnodes = nnodes
        self.script = script
        self.max_restarts = max_restarts
        self.port = free_port()
        self.env = clean_env()
        self.env.pop("PYTHONPATH")  # the installed package, as a user has it
        self.env.update(
            FERROGRPC_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S),
            OUT_DIR=str(tmp),
            PYTHONUNBUFFERED="1",
            LOGLEVEL="INFO",  # torchrun's agents say when they restart workers
            **env,
        )
        # torchrun's own c10d rendezvous (the anchor) needs no coordinator:
        # its agents serve the store at the endpoint.
        self.coordinator = None
        if rdzv == "ferrogrpc":
            self.coordinator = subprocess.Popen(
                [
                    *(sys.executable, "-m", "server", "--world-size", str(world_size)),
                    *("--host", "127.0.0.1", "--port", str(self.port)),
                ],
                cwd=ROOT,
                env={**self.env, "PYTHONPATH": str(ROOT)},
                stdout=open(tmp / "coordinator.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
        self.nodes: dict[str, Node] = {}

    def start(self, name: str, addr: str, nproc: int = 2) -> Node:
        node = self.nodes[name] = Node(self, name, addr, nproc)
        return node

    def lines(self) -> list[dict[str, Any]]:
        return [d for node in self.nodes.values() for d in node.lines()]

    def steps(self) -> list[dict[str, Any]]:
        return [d for d in self.lines() if "idx" in d]

    def output(self) -> str:
        parts = []
        for path in sorted(self.tmp.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        for node in self.nodes.values():
            for (attempt, local), path in sorted(node.files().items()):
                text = path.read_text(errors="replace")[-2500:]
                err = (path.parent / "stderr.log").read_text(errors="replace")[-2500:]
                parts.append(f"--- {node.name} attempt {attempt} rank {local}\n{text}\n{err}")
        return "\n".join(parts)

    def wait_for(self, what: Callable[[], Any], timeout: float, why: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            time.sleep(0.1)
        raise AssertionError(f"{why} within {timeout}s\n{self.output()}")

    def close(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.kill()
            node.out.close()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.kill()
            self.coordinator.wait()


def _digests_agree(job: TorchrunJob) -> None:
    """Every contributor to a step holds the same parameters after it."""
    by_step: dict[int, set[str]] = {}
    for d in job.steps():
        by_step.setdefault(d["step"], set()).add(d["params"])
    split = {step: sorted(ds) for step, ds in by_step.items() if len(ds) != 1}
    assert not split, split


class Contributions:
    """What check_training reads of ``job``, with the slices of the workers
    that a SIGKILL from outside (at one of ``kills``) took after their last
    sync was committed and before they printed it: each line names its rank
    and world size, so the ranks missing from a step are known."""

    def __init__(self, job: TorchrunJob, kills: list[float]) -> None:
        self.job, self.tmp, self.kills = job, job.tmp, kills

    def output(self) -> str:
        return self.job.output()

    def lines(self) -> list[dict[str, Any]]:
        lines = self.job.lines()
        by_step: dict[int, list[dict[str, Any]]] = {}
        for d in lines:
            if "idx" in d:
                by_step.setdefault(d["step"], []).append(d)
        missing = []
        for step, seen in by_step.items():
            (world,) = {d["world"] for d in seen}
            for rank in sorted(set(range(world)) - {d["rank"] for d in seen}):
                assert min(abs(seen[0]["t"] - t) for t in self.kills) < 5.0, (step, seen)
                idx = list(range(rank, 12, world))  # elastic_train.BATCH: 12
                missing.append({"step": step, "idx": idx, "world": world, "rank": rank})
        assert len(missing) <= 3, missing  # the worker, then node a's two, at most
        return lines + missing


@pytest.mark.timeout(240)
def test_torchrun_restarts_a_nodes_workers_only_and_nodes_come_and_go_live(
    tmp_path: Path, report: Callable[[str], None]
) -> None:
    # Two nodes (agents) of two workers, --nnodes=1:3 (min_world_size 2):
    # 1. a worker of node a is SIGKILLed: a's agent restarts a's workers,
    #    which join live; node b's workers run on, never restarted;
    # 2. node a dies whole (its agent and workers SIGKILLed): b goes on;
    # 3. node c starts: its workers join, and nobody restarts.
    steps = 300
    job = TorchrunJob(
        tmp_path,
        world_size=4,
        nnodes="1:3",
        STEPS=str(steps),
        WORLD="4",
        SLOW="0.3",
        PACE="0.03",
        # The "nodes" share this host: no shared memory, so that they meet
        # over gRPC as separate hosts do (and a node's two deaths, its
        # worker's and then its sibling's, SIGTERMed by the agent, are not
        # felt in another node's shared-memory plane).
        FERROGRPC_SHM="0",
        END_FILE=str(tmp_path / "end-step"),
    )
    try:
        a = job.start("a", "127.0.0.1")
        b = job.start("b", "127.0.0.2")
        job.wait_for(
            lambda: len([d for d in job.steps() if d["world"] == 4 and d["step"] >= 2]) >= 4,
            90,
            "the four workers never trained together",
        )
        b_pids = b.pids(0)
        assert len(b_pids) == 2
        # 1. One worker of node a dies.
        victim = a.pids(0)[0]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        job.wait_for(
            lambda: [d for d in a.lines() if d["attempt"] == 1 and d.get("world") == 4],
            90,
            "node a's restarted workers never trained with node b's",
        )
        back = min(d["t"] for d in a.lines() if d["attempt"] == 1 and d.get("world") == 4)
        # The survivors' first step without the dead worker's share.
        survivors = min(d["t"] for d in b.lines() if d.get("world", 4) < 4 and d["t"] > t_kill)
        report(
            f"torchrun (ferrogrpc rendezvous), a worker SIGKILLed: the other node's next step "
            f"{survivors - t_kill:.2f}s later, no restart; its own node's restarted workers "
            f"trained with the group {back - t_kill:.1f}s later (process start-up)"
        )
        # 2. Node a dies whole; b trains on.
        a.kill()
        t_node = time.time()
        job.wait_for(
            lambda: [d for d in b.lines() if d.get("world") == 2 and d["t"] > t_node],
            30,
            "node b never trained on alone",
        )
        # 3. Node c arrives; its workers join, nobody restarts.
        c = job.start("c", "127.0.0.3")
        job.wait_for(
            lambda: [d for d in c.lines() if d.get("world") == 4],
            90,
            "node c's workers never trained with node b's",
        )
        # Every worker trains: the run ends 5 steps on (elastic_train.py's
        # END_FILE), not at its step budget.
        steps = len({d["step"] for d in job.steps()}) + 5
        elastic_train.write_end(tmp_path / "end-step", steps)
        for node in (b, c):
            assert node.proc.wait(timeout=120) == 0, job.output()
    finally:
        job.close()
    # Nobody but node a restarted: one attempt each, the same two processes
    # on b from the first step to the last.
    assert a.attempts() == {0, 1} and b.attempts() == {0} and c.attempts() == {0}, job.output()
    assert b.pids(0) == b_pids
    b_steps = {d["step"] for d in b.lines() if "idx" in d}
    assert b_steps == set(range(steps)), sorted(set(range(steps)) - b_steps)
    for name, restarts in (("a", 1), ("b", 0), ("c", 0)):
        agent = (tmp_path / f"agent-{name}.log").read_text()
        assert agent.count("will restart worker group") == restarts, agent
        assert agent.count("Rendezvous complete for workers") == restarts + 1, agent
    # Every member bitwise equal at every step; every step kept once, and
    # equal to single-process training on the slices that contributed.
    _digests_agree(job)
    check_training(cast(Any, Contributions(job, [t_kill, t_node])), steps)


@pytest.mark.timeout(120)
def test_below_the_minimum_nodes_torchrun_exits_non_zero(tmp_path: Path) -> None:
    # --nnodes=2:3 with one worker a node: min_world_size 2. Node a dies
    # whole: b's worker raises QuorumLostError and exits non-zero; its
    # agent would restart it, but the group is over: the rendezvous is
    # closed, and torchrun exits non-zero (not after --max-restarts tries).
    job = TorchrunJob(
        tmp_path,
        world_size=2,
        nnodes="2:3",
        max_restarts=100,
        STEPS="400",
        WORLD="2",
        PACE="0.05",
    )
    try:
        a = job.start("a", "127.0.0.1", nproc=1)
        b = job.start("b", "127.0.0.2", nproc=1)
        job.wait_for(
            lambda: len([d for d in job.steps() if d["step"] >= 2]) >= 2, 90, "no training"
        )
        a.kill()
        t_kill = time.time()
        code = b.proc.wait(timeout=60)
        took = time.time() - t_kill
    finally:
        job.close()
    assert code != 0, job.output()
    quorum = [d for d in b.lines() if d.get("event") == "quorum"]
    assert quorum and quorum[0]["lost"] in ([0], [1]), job.output()
    agent = (tmp_path / "agent-b.log").read_text()
    assert "is over" in agent and "quorum lost" in agent, agent
    assert b.attempts() == {0}, job.output()  # closed before any restart
    assert took < 30, took


@pytest.mark.timeout(240)
def test_the_anchor_torchruns_own_rendezvous_restarts_every_worker_from_a_checkpoint(
    tmp_path: Path, report: Callable[[str], None]
) -> None:
    # The anchor: the same two nodes of two workers, the same model, data
    # and kill, under torchrun's own c10d rendezvous (--nnodes=2, its fixed
    # form: a growing one waits its last-call timeout, 30 s, first). One
    # worker's death restarts every worker on every node; they resume from
    # rank 0's checkpoint of the last step.
    kill_file = tmp_path / "kill-now"
    job = TorchrunJob(
        tmp_path,
        world_size=4,
        nnodes="2",
        rdzv="c10d",
        script=RANKS / "c10d_train.py",
        STEPS="400",
        PACE="0.2",
        KILL_FILE=str(kill_file),
        FILE_KILL_RANK="1",
        # torch's own DDP over gloo: the anchor is torchrun's own stack (and
        # a store of its own each round: the round's workers never read the
        # last round's keys).
        DDP="gloo",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    try:
        a = job.start("a", "127.0.0.1")
        job.start("b", "127.0.0.2")
        job.wait_for(
            lambda: len([d for d in job.steps() if d["step"] >= 3]) >= 4, 90, "no training"
        )
        ends = sorted({d["t"] for d in job.steps() if d["rank"] == 0})
        step_time = ends[-1] - ends[-2]
        before = {d["pid"] for d in job.lines() if d.get("event") == "start"}
        kill_file.touch()
        killed = job.wait_for(
            lambda: [d for d in job.lines() if d.get("event") == "kill"], 30, "no kill"
        )[0]
        resumed = job.wait_for(
            lambda: [d for d in job.steps() if d["t"] > killed["t"] + 0.5 and d["world"] == 4],
            120,
            "no step after the restart",
        )
        # (A node whose restart count stays 0, restarted for the other's
        # sake, writes its new workers' logs over its first attempt's.)
        starts = [d for d in job.lines() if d.get("event") == "start" and d["t"] > killed["t"]]
    finally:
        job.close()
    after = min(d["t"] for d in resumed) - killed["t"]
    report(
        f"anchor, torchrun's c10d rendezvous, a worker SIGKILLed: every worker restarted, the "
        f"next step {after:.1f}s later, resumed from the checkpoint (step {step_time:.2f}s)"
    )
    # Every worker of both nodes was restarted (new processes), none kept,
    # and each resumed from the checkpoint.
    assert len(before) == 4 and len(starts) == 4 and not before & {d["pid"] for d in starts}
    assert all(d["resumed"] > 0 for d in starts), starts
    assert a.attempts() == {0, 1}, job.output()
