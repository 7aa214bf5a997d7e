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
import threading
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


# A rank of an env:// job: init_backend, then one JSON line with how long it
# took and what it raised. torch, and the modules ferrogrpc imports lazily
# in init_backend, are imported first: their import is no part of the
# rendezvous (under the suite's load it once took 2.6 s past the timeout).
RENDEZVOUS_RANK = """
import json, time
import torch, torch.distributed
import ferrogrpc as fg
import ferrogrpc.control.rendezvous, ferrogrpc.runtime.backend, ferrogrpc.runtime.peer
start = time.monotonic()
try:
    fg.init_backend().close()
    out = {"error": None, "message": ""}
except fg.FerroGrpcError as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
out["elapsed"] = time.monotonic() - start
print(json.dumps(out))
"""
CONNECT_S = 5.0


def _rendezvous_ranks(ranks: list[tuple[int, int, int]]) -> list[tuple[dict[str, object], str]]:
    """Run one process per (RANK, WORLD_SIZE, MASTER_PORT) at once, with a
    connect timeout of CONNECT_S; each one's JSON line and its stderr."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RENDEZVOUS_RANK],
            env=dict(
                clean_env(),
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                FERROGRPC_CONNECT_TIMEOUT=str(CONNECT_S),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, world, port in ranks
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        results.append((json.loads(out.strip().splitlines()[-1]), err))
    return results


def _one_line_in_time(result: dict[str, object], stderr: str) -> None:
    # The connect timeout, honoured (within 10% and a second), and no C++
    # stack trace from torch's store on the way.
    assert float(result["elapsed"]) <= CONNECT_S * 1.1 + 1, result  # type: ignore[arg-type]
    assert "frame #" not in stderr and "c10d" not in stderr, stderr[-3000:]
    assert "\n" not in str(result["message"]), result


@pytest.mark.timeout(90)
def test_env_rendezvous_names_the_missing_rank_within_the_connect_timeout() -> None:
    # Ranks 0 and 1 of WORLD_SIZE=3, rank 2 never comes; and, elsewhere, a
    # rank 1 whose rank 0 never comes (nothing listens at MASTER_PORT).
    port, lonely = free_port(), free_port()
    (r0, e0), (r1, e1), (alone, e2) = _rendezvous_ranks(
        [(0, 3, port), (1, 3, port), (1, 2, lonely)]
    )
    for result, stderr in ((r0, e0), (r1, e1)):
        assert result["error"] == "RendezvousError", result
        assert "rank 2 of WORLD_SIZE=3 did not publish" in str(result["message"]), result
        assert "published: ranks 0, 1" in str(result["message"]), result
        _one_line_in_time(result, stderr)
    assert alone["error"] == "RendezvousError", alone
    assert f"no TCPStore answered at 127.0.0.1:{lonely} within 5s" in str(alone["message"])
    _one_line_in_time(alone, e2)


# Rank 0 of a 3-rank job, serving the store: it publishes its entry, says
# so, and waits to be killed.
STORE_HOST = """
import sys, json, datetime
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True,
                      timeout=datetime.timedelta(seconds=60))
store.set("job/peer/0", json.dumps({"address": "a", "nonce": "n", "world_size": "3"}))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_a_rank_whose_store_host_dies_first_still_names_the_missing_rank() -> None:
    # CI once saw rank 1 of 3 report only "the TCPStore failed: Failed to
    # recv" when rank 0, which serves the store, gave up on the missing
    # rank 2 a moment before rank 1 did. Rank 0 now waits a little longer
    # than the others; and if its store closes first all the same (here:
    # SIGKILLed), rank 1 still names rank 2, from its last look.
    from datetime import timedelta

    from ferrogrpc.control.rendezvous import exchange_through_store

    port = free_port()
    host = subprocess.Popen(
        [sys.executable, "-c", STORE_HOST, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)
        )
        killer = threading.Timer(1.5, host.kill)
        killer.start()
        start = time.monotonic()
        with pytest.raises(fg.RendezvousError) as caught:
            exchange_through_store(
                store, "job/", 1, 3, {"address": "b", "nonce": "m"}, 20.0, hosted_here=True
            )
        killer.join()
    finally:
        host.kill()
        host.wait()
    message = str(caught.value)
    assert "rank 2 of WORLD_SIZE=3 did not publish" in message, message
    assert "published: ranks 0, 1" in message, message
    assert "before rank 0 closed the store" in message, message
    assert time.monotonic() - start < 10, message


@pytest.mark.timeout(90)
def test_env_ranks_that_disagree_on_world_size_are_told_so() -> None:
    port = free_port()
    results = _rendezvous_ranks([(0, 2, port), (1, 3, port)])
    for result, stderr in results:
        assert result["error"] == "ConfigError", result
        message = str(result["message"])
        assert "WORLD_SIZE=2 on rank 0; WORLD_SIZE=3 on rank 1" in message, result
        # Told as soon as both published: not at the connect timeout.
        assert float(result["elapsed"]) < CONNECT_S, result  # type: ignore[arg-type]
        assert "frame #" not in stderr, stderr[-3000:]
