"""Configuration claims of the README, through init_backend as a job sets
them: the default bind address (loopback when the master is, every
interface otherwise) and FERROGRPC_BIND_HOST narrowing it, seen by
connecting from another network namespace; FERROGRPC_TIMEOUT as the
collective deadline. (The token and TLS variables: tests/test_security.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import ferrogrpc as fg
from tests.helpers import RANKS, SUBNET, backends, clean_env, free_port, ip, namespaces

HOST, OUTSIDER = f"{SUBNET}.10", f"{SUBNET}.11"
SECOND = f"{SUBNET}.20"  # a second address of the rank's host

# Tries a TCP connection to each host:port given; prints {target: outcome}.
PROBE = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        out[target] = "open"
    except OSError as exc:
        out[target] = type(exc).__name__
print(json.dumps(out))
"""


def _probe(namespace: str, targets: list[str]) -> dict[str, str]:
    proc = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", PROBE, *targets],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.timeout(90)
def test_default_bind_address_and_bind_host_seen_from_another_host() -> None:
    assert os.geteuid() == 0, "needs root for ip netns (CI runs as root)"
    cases = {
        # master on loopback: a single-machine job, bound to 127.0.0.1
        "loopback master": {"MASTER_ADDR": "127.0.0.1"},
        # master on the network: bound to every interface
        "network master": {"MASTER_ADDR": HOST},
        # ... unless FERROGRPC_BIND_HOST names one
        "FERROGRPC_BIND_HOST": {"MASTER_ADDR": HOST, "FERROGRPC_BIND_HOST": SECOND},
    }
    with namespaces(["host", "outsider"]) as ns:
        device = next(
            line.split(":")[1].strip().split("@")[0]
            for line in ip("-n", ns["host"], "-o", "link", "show").stdout.splitlines()
            if ": lo:" not in line
        )
        ip("-n", ns["host"], "addr", "add", f"{SECOND}/24", "dev", device)
        procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for case, env in cases.items():
                procs[case] = subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns["host"],
                        sys.executable,
                        str(RANKS / "bind_probe.py"),
                    ],
                    env=dict(
                        clean_env(),
                        RANK="0",
                        WORLD_SIZE="1",
                        MASTER_PORT=str(free_port()),
                        **env,
                    ),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            ports = {}
            for case, proc in procs.items():
                assert proc.stdout is not None
                seen: list[str] = []
                # Blocks until the peer is up (or its process has ended).
                for line in proc.stdout:
                    seen.append(line)
                    if line.startswith("LISTENING "):
                        ports[case] = line.split()[1]
                        break
                assert case in ports, (case, "".join(seen))
            targets = [f"{address}:{port}" for port in ports.values() for address in (HOST, SECOND)]
            outside = _probe(ns["outsider"], targets)
            inside = _probe(ns["host"], [f"127.0.0.1:{port}" for port in ports.values()])
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    assert proc.stdin is not None
                    proc.stdin.write("done\n")
                    proc.stdin.flush()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    seen = {
        case: (outside[f"{HOST}:{port}"], outside[f"{SECOND}:{port}"], inside[f"127.0.0.1:{port}"])
        for case, port in ports.items()
    }
    print("from the other host (host address, second address), from the host itself:", seen)
    # Not reachable from the network at all, only on the machine itself.
    assert seen["loopback master"] == ("ConnectionRefusedError",) * 2 + ("open",), seen
    # Every interface.
    assert seen["network master"] == ("open", "open", "open"), seen
    # Only the named one.
    assert seen["FERROGRPC_BIND_HOST"] == (
        "ConnectionRefusedError",
        "open",
        "ConnectionRefusedError",
    ), seen


@pytest.mark.timeout(60)
def test_ferrogrpc_timeout_is_the_collective_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 never calls the collective but answers pings (a late rank, not a
    # stuck one): with a 60 s idle timeout, only the 2 s deadline can end
    # rank 0's wait.
    monkeypatch.setenv("FERROGRPC_TIMEOUT", "2")
    monkeypatch.setenv("FERROGRPC_IDLE_TIMEOUT", "60")
    group = backends(2)
    try:
        start = time.monotonic()
        work = group[0].all_reduce(torch.ones(10), async_op=True)
        with pytest.raises(fg.CollectiveTimeoutError) as info:
            work.wait(timeout=20)
        elapsed = time.monotonic() - start
    finally:
        for b in group:
            b.close()
    assert "2s collective deadline" in str(info.value), info.value
    assert 1.5 < elapsed < 10, elapsed


def _timeout_marks() -> dict[str, float]:
    """Every ``pytest.mark.timeout(...)`` of the test modules, evaluated
    against its module's constants, by where it stands."""
    import ast

    from tests.helpers import ROOT

    found: dict[str, float] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        constants: dict[str, object] = {}
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    try:
                        constants[target.id] = eval(  # a constant expression of the module
                            compile(ast.Expression(node.value), str(path), "eval"),
                            {"__builtins__": {}},
                            dict(constants),
                        )
                    except Exception:
                        continue
        for call in ast.walk(ast.parse(source)):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "timeout"
                and isinstance(call.func.value, ast.Attribute)
                and call.func.value.attr == "mark"
            ):
                value = compile(ast.Expression(call.args[0]), str(path), "eval")
                found[f"{path.name}:{call.lineno}"] = float(
                    eval(value, {"__builtins__": {}}, dict(constants))
                )
    return found


def test_faulthandler_never_dumps_in_a_green_run() -> None:
    # pytest's faulthandler_timeout dumps every thread's stack once a test
    # has run that long, passing or not: below a test's own timeout it
    # printed a dump in the middle of a green run (the compose tests run
    # for minutes). It must lie above every test's timeout; pytest-timeout
    # dumps the stacks of a test that runs into its own.
    import tomllib

    from tests.helpers import ROOT

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    ini = options["ini_options"]
    marks = _timeout_marks()
    assert len(marks) > 100, marks  # the marks were found
    longest = max([float(ini["timeout"]), *marks.values()])
    assert float(ini["faulthandler_timeout"]) > longest, (
        f"faulthandler_timeout {ini['faulthandler_timeout']} is not above the longest test "
        f"timeout, {longest:g}s ({[w for w, t in marks.items() if t == longest]})"
    )
