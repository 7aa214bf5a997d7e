"""``ferrogrpc launch``: run N local ranks of a script with torchrun's
variables; forward signals; if one rank fails, stop the rest and name it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

# Where free_port looks first: below the kernel's ephemeral range, and not
# among the ports torch's launchers and this project's benches name
# (torchrun's 29500 and its neighbours).
FREE_PORTS_FROM = 10_000
NAMED_PORTS = range(29_000, 30_000)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process started later to bind
    (a master port). It is drawn below the kernel's ephemeral range
    (``ip_local_port_range``), so that no socket the kernel numbers meanwhile
    (a connection's own end, a bind to port 0) can take it before its user
    binds it (one drawn by a bind to port 0 can be, on a machine where many
    processes connect: the suspected cause of ranks that failed to start in
    full test suites). Only where that range is unknown, or nothing below
    it is free, a port the kernel picks."""
    low = _ephemeral_low()
    if low is not None and low > FREE_PORTS_FROM:
        rng = random.Random()  # its own: not the draws of a program that seeded random
        for _ in range(64):
            port = rng.randrange(FREE_PORTS_FROM, low)
            if port in NAMED_PORTS:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), if known."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def rank_env(
    rank: int,
    world: int,
    master_port: int,
    *,
    master_addr: str = "127.0.0.1",
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment torchrun gives a local rank (plus ``extra``)."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    env.update(extra or {})
    return env


def spawn_ranks(
    world: int, argv: Sequence[str], *, capture: bool = True, **extra: str
) -> list[subprocess.Popen[str]]:
    """Start ``world`` local ranks of ``argv`` on a fresh master port, with
    stdout captured as text when ``capture`` (for programs that collect the
    ranks' results)."""
    port = free_port()
    return [
        subprocess.Popen(
            list(argv),
            env=rank_env(rank, world, port, extra=extra),
            stdout=subprocess.PIPE if capture else None,
            text=True,
        )
        for rank in range(world)
    ]


def launch(
    nproc: int,
    command: Sequence[str],
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    grace_s: float = 5.0,
    env: dict[str, str] | None = None,
) -> int:
    """Start ``nproc`` copies of ``command`` with RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Returns 0 when all
    succeed. When a rank exits non-zero, the others get SIGTERM (SIGKILL
    after ``grace_s``) and the failed rank is named on stderr; its exit code
    is returned. SIGINT and SIGTERM are forwarded to every rank."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    port = master_port or free_port()
    procs: list[subprocess.Popen[bytes]] = [
        subprocess.Popen(
            list(command), env=rank_env(rank, nproc, port, master_addr=master_addr, base=env)
        )
        for rank in range(nproc)
    ]

    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if received and all(c is not None for c in codes):
                if failed:
                    name = signal.Signals(received[0]).name
                    print(f"ferrogrpc launch: stopped by {name}", file=sys.stderr, flush=True)
                    return 128 + received[0]
                return 0
            if failed and not received:
                rank, code = failed[0]
                reason = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                print(
                    f"ferrogrpc launch: rank {rank} (pid {procs[rank].pid}) failed with {reason}; "
                    f"stopping the other {nproc - 1} rank(s)",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(procs, grace_s)
                return code if code and code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs, grace_s)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
