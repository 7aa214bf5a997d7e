"""What the benchmark programs share: sizes, the interleaved measurement,
and collecting the ranks' results. bench.py, bench_latency.py and
bench_train.py import it; it imports none of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20

# The checkout these programs run from.
ROOT = Path(__file__).resolve().parent.parent


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment, with the checkout first on PYTHONPATH
    (for another process that runs a program of it: ``-m client.X``), plus
    ``extra``."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_count(text: str) -> int:
    """A count in decimal units, as a model's parameters are given: ``25M``,
    ``200k``, ``2.5e6``."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text.strip()[-1:].upper(), 0)
    return int(float(text.strip()[:-1]) * scale) if scale else int(float(text))


def run_group(script: str, nproc: int, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """A coordinator (``python -m server``) for ``nproc`` ranks, each
    ``script --worker`` with ``env`` (FERROGRPC_COORDINATOR pointing at
    it is set here); the JSON lines the ranks printed, once all exited.
    Exits naming ``script``'s output if a rank printed none."""
    from ferrogrpc.testing import free_port

    port = free_port()
    env = {
        **env,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "FERROGRPC_COORDINATOR": f"127.0.0.1:{port}",
    }
    with tempfile.TemporaryDirectory() as tmp:
        coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(nproc)),
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            cwd=ROOT,
            env=env,
            stdout=(Path(tmp) / "coordinator.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        ranks = [
            subprocess.Popen(
                [sys.executable, script, "--worker"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for _ in range(nproc)
        ]
        try:
            outs = [r.communicate(timeout=timeout)[0].decode() for r in ranks]
        finally:
            for proc in [*ranks, coordinator]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    lines = [json.loads(x) for o in outs for x in o.splitlines() if x.startswith("{")]
    if len(lines) != nproc:
        raise SystemExit(f"{script}: a rank failed:\n" + "\n".join(o[-2000:] for o in outs))
    return lines


def rotated(names: list[str], i: int) -> list[str]:
    """``names`` starting at position ``i`` (mod its length): round ``i`` of an
    interleaved comparison, so that no implementation always runs right after
    the same other one."""
    k = i % len(names)
    return names[k:] + names[:k]


def measure(
    ops: dict[str, Callable[[], Any]],
    barrier: Callable[[], None],
    iters: int,
    warmup: int,
    before: dict[str, Callable[[], Any]] | None = None,
    after: dict[str, Callable[[], Any]] | None = None,
    start: Callable[[], float] | None = None,
    barriers: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, list[float]]:
    """Times of every implementation, after ``warmup`` calls of each: one
    iteration of each in turn, so that the shared machine's slow and fast
    spells fall on all of them alike. ``before[name]`` (preparing the input)
    and ``after[name]`` (checking the result) run around every call of
    ``ops[name]``, before its barrier and after its clock stops: untimed.

    Each call starts after ``barrier()`` (or ``barriers[name]()``, that
    implementation's own), timed from this rank's own start; or, with
    ``start``, at the instant ``start()`` returns (on ``time.monotonic``'s
    clock, which every process of one host shares), timed from that instant,
    so that no barrier's uneven exit is counted."""
    before = before or {}
    after = after or {}
    barriers = barriers or {}

    def call(name: str) -> float:
        if name in before:
            before[name]()
        if start is None:
            barriers.get(name, barrier)()
            began = time.monotonic()
        else:
            began = start()
        ops[name]()
        elapsed = time.monotonic() - began
        if name in after:
            after[name]()
        return elapsed

    for name in ops:
        for _ in range(warmup):
            call(name)
    times: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for i in range(iters):
        # The order rotates every round, so that no implementation always
        # runs right after another one's call.
        for name in rotated(names, i):
            times[name].append(call(name))
    return times


def collect(procs: Sequence[Any], timeout: float, what: str) -> Any:
    """Wait for every rank; return the JSON that rank 0 printed after RESULT."""
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            raise SystemExit(f"{what} rank {rank} exited with {p.returncode}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{what}: rank 0 printed no result")


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"
