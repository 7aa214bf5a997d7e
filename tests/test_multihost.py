"""docker-compose.yml's services, each in its own network namespace with its
own address, as separate hosts would run them.

No Docker engine runs on these machines, so this test reads the compose file
and runs every service's command and environment itself: one namespace for
the coordinator and one per rank replica, joined by a bridge in a hub
namespace. Compose's service names resolve through ``/etc/netns/<ns>/hosts``
(``ip netns exec`` mounts it over /etc/hosts). The addresses are in
198.18.0.0/24, the range reserved for network tests, and live only inside
these namespaces. Needs root (CI runs as root); every namespace is removed
even when the test fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import RANKS as RANKS_DIR
from tests.helpers import ROOT, SUBNET, clean_env, namespaces

RANKS = 3
COMPOSE = ROOT / "docker-compose.yml"

# Runs a rank's command (``-m MODULE ARGS...`` or ``SCRIPT ARGS...``) once
# torch and ferrogrpc are imported and a line arrives on stdin:
# ``python -c GATE <the command's arguments>``.
GATE = """
import os, runpy, sys
import torch, ferrogrpc
print("READY", flush=True)
sys.stdin.readline()
target = sys.argv[1:]
if target[0] == "-m":
    sys.argv = target[1:]
    runpy.run_module(target[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = target
    sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
    runpy.run_path(target[0], run_name="__main__")
"""


def _substitute(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} interpolation."""

    def repl(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", repl, value)


def _program(name: str) -> str:
    """The image's programs are this interpreter's here: its python, and
    the commands its install put beside it (``ferrogrpc``)."""
    if name == "python":
        return sys.executable
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


def _service(spec: dict[str, object], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    command = [_substitute(str(part), env) for part in spec["command"]]  # type: ignore[attr-defined]
    command[0] = _program(command[0])
    raw_env = spec.get("environment") or {}
    if isinstance(raw_env, list):
        raw_env = dict(item.split("=", 1) for item in raw_env)
    service_env = {str(k): _substitute(str(v), env) for k, v in raw_env.items()}  # type: ignore[attr-defined]
    return command, service_env


def _start(
    ns: str, command: list[str], env: dict[str, str], gated: bool = False
) -> subprocess.Popen[str]:
    if gated:
        command = [command[0], "-c", GATE, *command[1:]]
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *command],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE if gated else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _release(procs: list[tuple[str, subprocess.Popen[str]]]) -> None:
    """Wait until every gated process has imported (a rank's imports take
    seconds on a busy machine), then let them all through at once: they
    join within the coordinator's join window however long the imports
    took."""
    for name, proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "READY\n", f"{name} did not reach the gate: {line}{proc.stdout.read()}"
    for _, proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def _wait_all(procs: list[tuple[str, subprocess.Popen[str]]], timeout: float) -> list[str]:
    outputs = []
    deadline = time.monotonic() + timeout
    for name, proc in procs:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, f"{name} failed:\n{out}"
        outputs.append(out)
    return outputs


def _records(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# Ranks per host (namespace): 2 hosts x 2 ranks, and 2 + 1 (uneven hosts).
# One rank per host, every byte over gRPC, is what the real compose test
# (tests/test_compose.py, one container per replica) runs.
# (Uneven layouts, 2+1 and more, run in-process in test_collectives' two-level
# conformance: the suite keeps one layout here, for its 15 s.)
LAYOUTS = {"2x2": [2, 2]}


@pytest.mark.timeout(240)
def _single_process_checksums(steps: int) -> list[float]:
    """client.train's run (its defaults, as the compose file's command
    leaves them) in one process on each step's whole batch: the sum of the
    parameters after each step."""
    import torch
    from torch import nn

    from client.train import build_model, global_batch, make_optimizer

    model = build_model(64, 0)
    opt = make_optimizer(model.parameters(), 0.01)
    out = []
    for step in range(steps):
        x, y = global_batch(step, 48, 0)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        with torch.no_grad():
            out.append(float(sum(p.double().sum() for p in model.parameters())))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compose_services_train_across_network_namespaces(layout: str) -> None:
    assert os.geteuid() == 0, "the multi-host test needs root for ip netns (CI runs as root)"
    per_host = LAYOUTS[layout]
    world = sum(per_host)
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) >= {"coordinator", "rank"}
    assert services["rank"]["deploy"]["replicas"] >= RANKS
    # The compose defaults: the coordinator sizes the group by who joins.
    # With a token: the coordinator, its healthcheck and every rank use it.
    host_env = {
        "FERROGRPC_JOIN_WINDOW": "2",
        "FERROGRPC_STEPS": "8",
        "FERROGRPC_TOKEN": f"compose-token-{layout}",
    }
    coord_cmd, coord_env = _service(services["coordinator"], host_env)
    # Compose's coordinator ends once its run's ranks have left; this one
    # serves a second job (the byte count below), so it stays.
    assert "--exit-when-done" in coord_cmd, coord_cmd
    coord_cmd.remove("--exit-when-done")
    rank_cmd, rank_env = _service(services["rank"], host_env)
    assert rank_env["FERROGRPC_COORDINATOR"].startswith("coordinator:")
    assert (
        coord_env["FERROGRPC_TOKEN"] == rank_env["FERROGRPC_TOKEN"] == host_env["FERROGRPC_TOKEN"]
    )

    hosts = ["coordinator"] + [f"rank-{i}" for i in range(1, len(per_host) + 1)]
    base_env = clean_env()
    procs: list[subprocess.Popen[str]] = []

    def ranks(command: list[str]) -> list[tuple[str, subprocess.Popen[str]]]:
        started = []
        for host, count in zip(hosts[1:], per_host, strict=True):
            for i in range(count):
                # Ranks sharing a host (a namespace) need ports of their own.
                port = int(rank_env.get("FERROGRPC_PORT", "29500")) + i
                env = {**base_env, **rank_env, "FERROGRPC_PORT": str(port)}
                proc = _start(ns[host], command, env, gated=True)
                procs.append(proc)
                started.append((f"{host}/{i}", proc))
        _release(started)
        return started

    with namespaces(hosts) as ns:
        try:
            procs.append(_start(ns["coordinator"], coord_cmd, dict(base_env, **coord_env)))
            # The compose healthcheck, run in the coordinator's namespace.
            health = services["coordinator"]["healthcheck"]["test"][1:]
            health = [_program(health[0]), *health[1:]]
            deadline = time.monotonic() + 60
            while True:
                probe = subprocess.run(
                    ["ip", "netns", "exec", ns["coordinator"], *health],
                    env=dict(base_env, **coord_env),  # the container's environment
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                )
                if probe.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"coordinator never healthy: {probe.stderr}"
                time.sleep(0.5)
            outputs = _wait_all(ranks(rank_cmd), 120)
            sharing = any(count > 1 for count in per_host)
            measured = _wait_all(ranks([sys.executable, str(RANKS_DIR / "hier_bytes.py")]), 120)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()

    checksums: dict[int, dict[int, float]] = {}
    addresses = set()
    paths = set()
    for out in outputs:
        records = _records(out)
        joined = next(r for r in records if r.get("event") == "joined")
        addresses.add(str(joined["address"]).rsplit(":", 1)[0])
        paths.add(joined["path"])
        steps = {int(r["step"]): float(r["checksum"]) for r in records if "checksum" in r}  # type: ignore[arg-type]
        assert len(steps) == 8, out
        checksums[int(joined["rank"])] = steps  # type: ignore[call-overload]
    assert sorted(checksums) == list(range(world)), "the coordinator must assign ranks 0..N-1"
    assert addresses == {f"{SUBNET}.{11 + i}" for i in range(len(per_host))}, addresses
    # Ranks in different namespaces are different hosts: gRPC between them,
    # shared memory only inside a namespace.
    assert paths == {"two-level" if sharing else "grpc"}, paths
    reference = _single_process_checksums(8)
    for step in range(8):
        values = {checksums[r][step] for r in range(world)}
        assert len(values) == 1, f"ranks disagree at step {step}: {values}"
        # The same training in one process, on the whole batch.
        got = values.pop()
        assert abs(got - reference[step]) <= 1e-6 * max(1.0, abs(reference[step])), (
            step,
            got,
            reference[step],
        )

    # Bytes that crossed hosts: each namespace's own interface counters,
    # over all_reduces of a known size. A ring of H hosts sends 2(H-1)/H of
    # the tensor per host; a flat ring over every rank sends at least
    # 2(W-1)/W of it across each host boundary it crosses.
    results = [_records(out)[-1] for out in measured]
    assert all(r["ok"] for r in results), results
    by_host: dict[str, int] = {}
    for r in results:
        host = str(r["address"]).rsplit(":", 1)[0]
        by_host[host] = max(by_host.get(host, 0), int(r["tx_bytes"]))  # type: ignore[call-overload]
    payload = int(results[0]["payload_bytes"])  # type: ignore[call-overload]
    count = len(per_host)
    ring_of_hosts = payload * 2 * (count - 1) / count
    flat_ring = payload * 2 * (world - 1) / world
    for host, sent in sorted(by_host.items()):
        ratio = sent / ring_of_hosts
        print(
            f"{layout}: host {host} sent {sent / 2**20:.1f} MiB across hosts for "
            f"{payload / 2**20:.0f} MiB of all_reduce: {ratio:.2f} x a ring of hosts "
            f"({flat_ring / ring_of_hosts:.2f} x for a flat ring)"
        )
        if sharing:
            assert 0.95 < ratio < 1.15, (host, sent, ring_of_hosts)
