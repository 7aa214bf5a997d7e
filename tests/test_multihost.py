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

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, clean_env

RANKS = 3
SUBNET = "198.18.0"
COMPOSE = ROOT / "docker-compose.yml"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _substitute(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} interpolation."""

    def repl(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", repl, value)


def _service(spec: dict[str, object], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    command = [_substitute(str(part), env) for part in spec["command"]]  # type: ignore[attr-defined]
    if command[0] == "python":
        command[0] = sys.executable  # the image's python is this interpreter here
    raw_env = spec.get("environment") or {}
    if isinstance(raw_env, list):
        raw_env = dict(item.split("=", 1) for item in raw_env)
    service_env = {str(k): _substitute(str(v), env) for k, v in raw_env.items()}  # type: ignore[attr-defined]
    return command, service_env


@contextlib.contextmanager
def namespaces(names: list[str]) -> Iterator[dict[str, str]]:
    """One namespace per name, each with an address on a shared bridge;
    yields name -> address. Removes everything on exit."""
    tag = f"fg{os.getpid() % 100000}"
    hub = f"{tag}-hub"
    created: list[str] = []
    addresses = {name: f"{SUBNET}.{10 + i}" for i, name in enumerate(names)}
    try:
        _ip("netns", "add", hub)
        created.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            ns = f"{tag}-{i}"
            _ip("netns", "add", ns)
            created.append(ns)
            outer, inner = f"{tag}h{i}", f"{tag}n{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "netns", hub)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", hub, "link", "set", outer, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addresses[name]}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            hosts = ["127.0.0.1 localhost"] + [f"{addr} {host}" for host, addr in addresses.items()]
            (etc / "hosts").write_text("\n".join(hosts) + "\n")
        yield {name: f"{tag}-{i}" for i, name in enumerate(names)} | {"__hub__": hub}
    finally:
        for ns in reversed(created):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@pytest.mark.timeout(180)
def test_compose_services_train_across_network_namespaces() -> None:
    assert os.geteuid() == 0, "the multi-host test needs root for ip netns (CI runs as root)"
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) >= {"coordinator", "rank"}
    assert services["rank"]["deploy"]["replicas"] >= RANKS
    # The compose defaults: the coordinator sizes the group by who joins.
    host_env = {"FERROGRPC_JOIN_WINDOW": "2", "FERROGRPC_STEPS": "8"}
    coord_cmd, coord_env = _service(services["coordinator"], host_env)
    rank_cmd, rank_env = _service(services["rank"], host_env)
    assert rank_env["FERROGRPC_COORDINATOR"].startswith("coordinator:")

    hosts = ["coordinator"] + [f"rank-{i}" for i in range(1, RANKS + 1)]
    base_env = clean_env()
    procs: list[subprocess.Popen[str]] = []
    with namespaces(hosts) as ns:
        try:
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns["coordinator"], *coord_cmd],
                    env=dict(base_env, **coord_env),
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            # The compose healthcheck, run in the coordinator's namespace.
            health = services["coordinator"]["healthcheck"]["test"][1:]
            health = [sys.executable if part == "python" else part for part in health]
            deadline = time.monotonic() + 60
            while True:
                probe = subprocess.run(
                    ["ip", "netns", "exec", ns["coordinator"], *health],
                    env=base_env,
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                )
                if probe.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"coordinator never healthy: {probe.stderr}"
                time.sleep(0.5)
            for host in hosts[1:]:
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns[host], *rank_cmd],
                        env=dict(base_env, **rank_env),
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
            outputs = []
            for host, proc in zip(hosts[1:], procs[1:], strict=True):
                out, _ = proc.communicate(timeout=120)
                assert proc.returncode == 0, f"{host} failed:\n{out}"
                outputs.append(out)
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
    for out in outputs:
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        joined = next(r for r in records if r.get("event") == "joined")
        addresses.add(joined["address"].rsplit(":", 1)[0])
        steps = {r["step"]: r["checksum"] for r in records if "checksum" in r}
        assert len(steps) == 8, out
        checksums[joined["rank"]] = steps
    assert sorted(checksums) == list(range(RANKS)), "the coordinator must assign ranks 0..N-1"
    assert addresses == {f"{SUBNET}.{11 + i}" for i in range(RANKS)}, addresses
    for step in range(8):
        values = {checksums[r][step] for r in range(RANKS)}
        assert len(values) == 1, f"ranks disagree at step {step}: {values}"
    print(f"multi-host: {RANKS} ranks at {sorted(addresses)} agree on all 8 steps")
