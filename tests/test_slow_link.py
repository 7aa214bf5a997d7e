"""A slow or lossy link is not a death (see [Note: liveness probe] in
ferrogrpc/transport/grpc_streams.py): two ranks in two network namespaces,
one of them late, on a link with a 600 ms round trip, or one that loses the
liveness probe's first connection attempts. The late rank is waited for,
and the collective is right. Delay and loss come from tests/delayer.py (an
NFQUEUE delayer: this kernel has no netem)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.delayer import delaying
from tests.helpers import ROOT, namespaces

pytestmark = pytest.mark.timeout(90)

LATE_S = 5.0  # past the probe's first rounds (at 2 s, then every 0.5 s)
IDLE_S = 16.0  # so that the silence bound is its floor, 4 s: a shorter test


def _job(ns: dict[str, str], addresses: dict[str, str], extra: dict[str, str]) -> list[dict]:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WORLD_SIZE="2",
        MASTER_ADDR=addresses["a"],
        MASTER_PORT="29501",
        FERROGRPC_PORT="29511",
        FERROGRPC_IDLE_TIMEOUT=str(IDLE_S),
        FERROGRPC_TIMEOUT="60",
        LATE_RANK="1",
        LATE_S=str(LATE_S),
    )
    env.update(extra)
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", ns[name], sys.executable, str(ROOT / "tests/ranks/late.py")],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, name in enumerate(("a", "b"))
    ]
    outs = [p.communicate(timeout=80)[0] for p in procs]
    records = []
    for out in outs:
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, out[-3000:]
        records.append(json.loads(lines[-1]))
    return records


@pytest.mark.parametrize("link", ["600 ms round trip", "first SYNs lost"])
def test_a_late_rank_on_a_slow_or_lossy_link_is_waited_for(link: str, tmp_path: Path) -> None:
    assert os.geteuid() == 0, "needs root for ip netns and nftables (CI runs as root)"
    addresses = {"a": "198.18.0.10", "b": "198.18.0.11"}
    with namespaces(["a", "b"]) as ns:
        # Armed once the job runs (the late rank arms it after a warm-up).
        arm = tmp_path / "arm"
        if link == "600 ms round trip":
            # Every packet from a to b waits 600 ms: each probe's SYN-ACK too.
            shaping = delaying(ns["a"], addresses["b"], delay_ms=600, arm_file=arm)
        else:
            # The first three connection attempts from a to b are lost (the
            # kernel resends a SYN after 1 s, then 2 s more).
            shaping = delaying(ns["a"], addresses["b"], drop_syns=3, arm_file=arm)
        with shaping:
            records = _job(ns, addresses, {"ARM_FILE": str(arm)})
    for record in records:
        assert "error" not in record, record
        assert record["result"] == [3.0] * 4, record
    assert records[0]["waited"] > LATE_S - 1, records  # it really waited for the late rank


def test_a_host_that_stays_silent_is_named_gone_within_the_silence_bound(
    tmp_path: Path,
) -> None:
    # Once armed, every connection attempt from a to b is lost: the late
    # rank's host looks vanished. Silence is a death only after
    # silence_bound(idle): 4 s of the 16 s idle timeout here.
    assert os.geteuid() == 0, "needs root for ip netns and iptables (CI runs as root)"
    from ferrogrpc.failure.watchdog import PROBE_S, silence_bound

    bound = silence_bound(IDLE_S)
    addresses = {"a": "198.18.0.10", "b": "198.18.0.11"}
    arm = tmp_path / "arm"
    with (
        namespaces(["a", "b"]) as ns,
        delaying(ns["a"], addresses["b"], drop_syns=10_000, arm_file=arm),
    ):
        late = PROBE_S + bound + 6.0  # it wakes after it was named
        records = _job(ns, addresses, {"ARM_FILE": str(arm), "LATE_S": str(late)})
    error = str(records[0].get("error", ""))
    assert "PeerError" in error and "rank 1" in error and "has not answered" in error, records
    assert bound <= records[0]["waited"] <= PROBE_S + bound + 5.0, (records[0], bound)
