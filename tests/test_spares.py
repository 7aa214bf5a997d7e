"""Hot spares (issue 58): the membership's rule on its own (a fake clock, no
network). A GROW admits joiners up to ``max_world_size``; the others wait
as spares. A RECOVER never admits anyone mid-step, and the next boundary's
GROW admits the first spare. Also what ``ferrogrpc status`` and the group's
metrics show of them."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from ferrogrpc.control.coordinator import Coordinator
from ferrogrpc.control.coordinator_client import fetch_status
from ferrogrpc.control.group_metrics import GroupCollector
from ferrogrpc.control.membership import ElasticMembership
from ferrogrpc.control.rounds import GroupOver, SettingMismatch, admitted
from ferrogrpc.v1 import rendezvous_pb2 as rpb

from .helpers import RANKS, ROOT
from .test_elastic import Run, check_training
from .test_membership import Clock, _enter

pytestmark = pytest.mark.timeout(30)


def _beat(m: ElasticMembership, peer: str, epoch: int = 0, rank: int = 0) -> rpb.HeartbeatResponse:
    return m.heartbeat(
        rpb.HeartbeatRequest(peer_id=peer, epoch=epoch, rank=rank, address=f"{peer}:1")
    )


def _placed(answers: list[Any]) -> list[tuple[int, int, int, int]]:
    """Each answer's (epoch, rank, world size, joined_from)."""
    return [(r.epoch, r.rank, r.world_size, r.joined_from) for r in answers]


def test_admitted_takes_joiners_in_order_up_to_the_bound() -> None:
    assert admitted(["d", "e"], 3, 0) == ["d", "e"]  # no bound
    assert admitted(["d", "e"], 3, 4) == ["d"]
    assert admitted(["d", "e"], 4, 4) == []
    assert admitted(["d", "e"], 5, 4) == []  # over it already (a lowered bound)


async def test_a_spare_waits_through_grows_and_a_recover_then_the_next_grow_admits_it() -> None:
    clock = Clock()
    m = ElasticMembership(
        heartbeat_timeout=2.0, join_window=0.1, initial_world_size=3, max_world_size=3, clock=clock
    )
    m.quiet = 0
    first = await asyncio.gather(*(_enter(m, p, rpb.ENTER_JOIN, 0) for p in "abc"))
    assert _placed(first) == [(1, r, 3, 3) for r in range(3)]
    spare = _enter(m, "d", rpb.ENTER_JOIN, 0)
    await asyncio.sleep(0.01)
    # The members are told nobody is to be admitted, yet connect to the
    # spare ahead; the spare is told it is one.
    beat = _beat(m, "a", 1, 0)
    assert beat.joiners_waiting == 0 and list(beat.joiner_addresses) == ["d:1"]
    assert _beat(m, "d").spare and not beat.spare
    assert m.waiting() == ([], ["d"])
    # A GROW (a stale count, say) at the bound admits nobody.
    grown = await asyncio.gather(*(_enter(m, p, rpb.ENTER_GROW, 1) for p in "abc"))
    assert _placed(grown) == [(2, r, 3, 3) for r in range(3)] and not spare.done()
    # b is lost mid-step: the RECOVER admits nobody (no state to hand out).
    recovered = await asyncio.gather(*(_enter(m, p, rpb.ENTER_RECOVER, 2, [1]) for p in "ac"))
    assert _placed(recovered) == [(3, 0, 2, 2), (3, 1, 2, 2)] and not spare.done()
    # The next heartbeat counts the spare; the boundary's GROW admits it.
    assert _beat(m, "a", 3, 0).joiners_waiting == 1 and not _beat(m, "d").spare
    answers = await asyncio.gather(spare, *(_enter(m, p, rpb.ENTER_GROW, 3) for p in "ac"))
    assert _placed(answers) == [(4, 2, 3, 2), (4, 0, 3, 2), (4, 1, 3, 2)]


async def test_the_members_bound_caps_the_first_epoch_and_spares_come_in_order() -> None:
    # No bound on the coordinator: the members' own (FERROGRPC_MAX_WORLD_SIZE,
    # or torchrun's --nnodes maximum). Four enter the first epoch, which
    # takes two; the others wait, and are admitted one at a time, in order.
    m = ElasticMembership(heartbeat_timeout=2.0, join_window=0.1, initial_world_size=4)
    m.quiet = 0
    entered = [_enter(m, p, rpb.ENTER_JOIN, 0, max_world_size=2) for p in "abcd"]
    first = await asyncio.gather(*entered[:2])
    assert _placed(first) == [(1, 0, 2, 2), (1, 1, 2, 2)] and m.max_world_size == 2
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in entered[2:]) and m.waiting() == ([], ["c", "d"])
    await asyncio.gather(_enter(m, "a", rpb.ENTER_RECOVER, 1, [1], max_world_size=2))
    assert m.waiting() == (["c"], ["d"])
    grow = _enter(m, "a", rpb.ENTER_GROW, 2, max_world_size=2)
    assert _placed(await asyncio.gather(entered[2], grow)) == [(3, 1, 2, 1), (3, 0, 2, 1)]
    assert not entered[3].done()
    # A joiner with another bound is refused; the group goes on.
    with pytest.raises(SettingMismatch, match=r"max_world_size 5.*runs with 2"):
        await _enter(m, "e", rpb.ENTER_JOIN, 0, max_world_size=5)
    entered[3].cancel()


async def test_a_silent_spare_is_dropped_and_the_next_one_is_admitted() -> None:
    clock = Clock()
    m = ElasticMembership(
        heartbeat_timeout=2.0, join_window=0.1, initial_world_size=2, max_world_size=2, clock=clock
    )
    m.quiet = 0
    await asyncio.gather(*(_enter(m, p, rpb.ENTER_JOIN, 0) for p in "ab"))
    stale, ready = _enter(m, "s", rpb.ENTER_JOIN, 0), _enter(m, "t", rpb.ENTER_JOIN, 0)
    await asyncio.sleep(0.01)
    clock.now += 1.5
    for p in ("a", "b"):
        _beat(m, p, 1, "ab".index(p))
    _beat(m, "t")
    clock.now += 1.0  # s is silent past the heartbeat timeout; t is not
    m.check_silence()
    assert m.waiting() == ([], ["t"]) and "s" not in m.joiners
    await _enter(m, "a", rpb.ENTER_RECOVER, 1, [1])
    answers = await asyncio.gather(ready, _enter(m, "a", rpb.ENTER_GROW, 2))
    assert _placed(answers) == [(3, 1, 2, 1), (3, 0, 2, 1)]
    stale.cancel()


async def test_a_spare_still_waiting_when_training_ends_is_told_and_starts_no_group() -> None:
    m = ElasticMembership(
        heartbeat_timeout=2.0, join_window=0.1, initial_world_size=2, max_world_size=2
    )
    m.quiet = 0
    await asyncio.gather(*(_enter(m, p, rpb.ENTER_JOIN, 0) for p in "ab"))
    spare = _enter(m, "s", rpb.ENTER_JOIN, 0)
    await asyncio.sleep(0.01)
    for p in "ab":  # both members closed their backend: training is done
        m.heartbeat(rpb.HeartbeatRequest(peer_id=p, epoch=1, leaving=True))
    with pytest.raises(GroupOver, match="every member of the last epoch left"):
        await spare
    assert m.epoch == 0 and m._first is None and m.ended


async def test_status_and_the_group_metrics_show_the_spares() -> None:
    coordinator = Coordinator(0, join_window=0.1, max_world_size=2)
    port = await coordinator.start("127.0.0.1:0")
    m = coordinator.membership
    m.quiet = 0
    try:
        await asyncio.gather(*(_enter(m, p, rpb.ENTER_JOIN, 0) for p in "ab"))
        spare = _enter(m, "c", rpb.ENTER_JOIN, 0)
        await asyncio.sleep(0.01)
        status = await fetch_status(f"127.0.0.1:{port}")
        assert (status.epoch, status.joined, status.max_world_size) == (1, 2, 2)
        assert [s.address for s in status.spares] == ["c:1"] and not status.joiners
        samples = {
            s.name: s.value
            for family in GroupCollector(coordinator).collect()
            for s in family.samples
            if not s.labels
        }
        assert samples["ferrogrpc_group_spares"] == 1
        assert samples["ferrogrpc_group_joiners_waiting"] == 0
        assert samples["ferrogrpc_group_max_world_size"] == 2
        spare.cancel()
    finally:
        await coordinator.stop(grace=0)


# ------------------------------------------------------ real processes


class Cold:
    """A replacement started cold, as a restarted process is: a new
    interpreter that imports torch and builds the model (shaped like the
    zygote's forks, for Run)."""

    def __init__(self, env: dict[str, str], out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, str(RANKS / "elastic_train.py")],
            env=env,
            cwd=ROOT,
            stdout=open(out, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()


def _status(run: Run) -> rpb.StatusResponse:
    return asyncio.run(fetch_status(f"127.0.0.1:{run.port}"))


def kill_to_next_step(tmp: Path, spare: bool, steps: int = 70) -> dict[str, float]:
    """Four members (max_world_size 4) at 0.2 s a step; rank 1 SIGKILLs
    itself; with ``spare``, a fifth process waits as a hot spare from the
    start, else a cold replacement starts at the death. Returns the seconds
    from the death to the first step the newcomer trained in, and the
    step time before it."""
    tmp.mkdir()
    kill_file = tmp / "kill-now"
    run = Run(
        tmp,
        4,
        STEPS=str(steps),
        SLOW="0.2",
        PACE="0.2",
        KILL_FILE=str(kill_file),
        FILE_KILL_RANK="1",
        FERROGRPC_MAX_WORLD_SIZE="4",
        END_FILE=str(tmp / "end-step"),
    )
    try:
        run.wait_for(lambda: [d for d in run.lines() if d.get("step", -1) >= 2], 60, "no steps")
        if spare:
            # A short connect timeout: a spare waits far longer than it.
            run.env = {**run.env, "FERROGRPC_CONNECT_TIMEOUT": "4"}
            run.start_rank()
            run.wait_for(lambda: len(_status(run).spares) == 1, 60, "the spare never waited")
            time.sleep(6.0)  # past its connect timeout; the members connected ahead
            assert len(_status(run).spares) == 1, run.output()
        first = len(run.procs) - 1 if spare else len(run.procs)
        kill_file.touch()
        kill = run.wait_for(
            lambda: [d for d in run.lines() if d.get("event") == "kill"], 30, "no kill"
        )[0]
        if not spare:
            run.procs.append(cast(Any, Cold(run.env, tmp / "cold.log")))
        joined = run.wait_for(
            lambda: [d for d in run.lines(first) if "idx" in d], 90, "the newcomer never trained"
        )[0]
        steps = run.end_soon()  # (every process left trains)
        run.finish(90)
    finally:
        run.close()
    by_step = check_training(run, steps)
    killed_at = max(d["step"] for d in run.lines(kill["proc"]) if "idx" in d) + 1
    ends = sorted(max(d["t"] for d in by_step[step]) for step in range(killed_at))
    step_time = statistics.median(b - a for a, b in itertools.pairwise(ends))
    assert joined["world"] == 4
    return {"after": joined["t"] - kill["t"], "step": step_time}


@pytest.mark.timeout(240)
def test_a_hot_spare_replaces_a_lost_member_within_a_step_a_cold_one_does_not(
    tmp_path: Path, report: Callable[[str], None]
) -> None:
    hot = kill_to_next_step(tmp_path / "hot", spare=True)
    cold = kill_to_next_step(tmp_path / "cold", spare=False)
    report(
        f"hot spare: SIGKILL to the survivors' first step with the spare in it "
        f"{hot['after']:.2f}s (step {hot['step']:.2f}s); a cold replacement's "
        f"{cold['after']:.2f}s (step {cold['step']:.2f}s)"
    )
    assert hot["after"] <= hot["step"] + 1.0, hot


@pytest.mark.timeout(120)
def test_a_process_beyond_world_size_at_the_start_joins_with_the_group_state(
    tmp_path: Path,
) -> None:
    # A coordinator for two and three processes that enter before the
    # first epoch forms (its quiet period): the first two form the group,
    # and the third, admitted through the Enter its init_backend made, is a
    # joiner (rank -1) until its first boundary hands it the state. It used
    # to come out of init_backend a member without the state: it trained
    # from step 0 with its own optimizer, silently apart from the others.
    steps = 40
    # A heartbeat timeout of 5 s: the coordinator's quiet period, within
    # which all three enter (at 2 s, the third, started last on a busy host,
    # sometimes entered after the first epoch formed: not the case here).
    run = Run(tmp_path, 2, STEPS=str(steps), SLOW="0.1", FERROGRPC_HEARTBEAT_TIMEOUT="5")
    try:
        run.start_rank()
        run.finish(90)
    finally:
        run.close()
    log = (tmp_path / "coordinator0.log").read_text()
    assert "3 processes entered the first epoch" in log, log  # (the case under test)
    assert "epoch 1 formed: 2 members" in log and "ENTER_RECOVER" not in log, log
    starts = [d for d in run.lines() if d.get("event") == "start"]
    joining = [d for d in starts if d["joining"]]
    assert len(starts) == 3 and len(joining) == 1 and joining[0]["rank"] == -1, starts
    mine = [d for d in run.lines(joining[0]["proc"]) if "idx" in d]
    assert mine and mine[-1]["step"] == steps - 1, run.output()
    check_training(run, steps)
