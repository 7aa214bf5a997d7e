"""Shared test helpers: float64 references and launching real rank processes."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch

import ferrogrpc as fg

# Network namespaces (root only) are client/netlab.py's, which the link
# benchmark uses too.
from client.forks import Fork, Template
from client.netlab import SUBNET as SUBNET
from client.netlab import ip as ip
from client.netlab import namespaces as namespaces
from ferrogrpc.control import launch
from ferrogrpc.transport.grpc_streams import SEND_METHOD

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
RANKS = Path(__file__).resolve().parent / "ranks"


free_port = launch.free_port


def reference_sum(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The independent reference: the inputs summed in float64."""
    return torch.stack([t.to(torch.float64) for t in inputs]).sum(0)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return {"atol": 1e-2, "rtol": 1e-2}
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return (
        {"atol": 0.0, "rtol": 0.0}
        if not dtype.is_floating_point
        else {"atol": 1e-12, "rtol": 1e-12}
    )


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return launch.rank_env(
        rank,
        world,
        port,
        extra={
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **extra,
        },
    )


class Forked(Fork):
    """A rank process forked by the :class:`Zygote`: client/forks.py's Fork
    whose output is collected here (``stdout``: what it printed so far),
    with a pipe to its standard input where asked for."""

    def __init__(self, conn: socket.socket, out: int | None, stdin: int | None = None) -> None:
        self._watch(conn)
        # Its standard input, where the caller gave it a pipe (text).
        self.stdin = None if stdin is None else os.fdopen(stdin, "w")
        self._out: list[bytes] = []
        # Its output is collected here unless it goes somewhere of the
        # caller's (``out`` None).
        self._reader: threading.Thread | None = None
        if out is not None:
            self._reader = threading.Thread(target=self._read, args=(out,), daemon=True)
            self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            while chunk := pipe.read1(1 << 16):
                self._out.append(chunk)

    @property
    def stdout(self) -> str:
        """What it printed so far."""
        return b"".join(self._out).decode(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._reader is not None:
            self._reader.join(left)  # its output, up to the pipe's end
        if self._reader is not None and self._reader.is_alive():
            raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0)
        return b"".join(self._out).decode(errors="replace"), None


class Zygote:
    """client/forks.py's template, started once per test session: rank
    processes are forks of one process that imported torch already (2 s of
    CPU each saved). Processes whose memory is measured from their start
    are not forked (run_ranks(fresh=True))."""

    _started: Zygote | None = None

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.template = Template(env=env, cwd=str(ROOT))

    @classmethod
    def get(cls) -> Zygote:
        if cls._started is None or not cls._started.template.alive():
            cls._started = cls()
        return cls._started

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        output: int | None = None,
        stdin: bool = False,
    ) -> Forked:
        """Fork a process that runs ``argv`` (a script and its arguments).
        Its output (stdout and stderr) goes to the file descriptor
        ``output`` when given (the caller's, left open), else it is
        collected; with ``stdin``, :attr:`Forked.stdin` writes to its
        standard input (else it reads /dev/null)."""
        read, write = os.pipe() if output is None else (None, os.dup(output))
        ours, theirs = os.pipe()[::-1] if stdin else (None, os.open(os.devnull, os.O_RDONLY))
        try:
            request = {"argv": argv, "env": env, "cwd": str(ROOT)}
            conn = self.template.request(request, write, write, theirs)
        except BaseException:
            for fd in (read, ours):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            os.close(write)
            os.close(theirs)
        return Forked(conn, read, ours)

    def close(self) -> None:
        self.template.close()


def spawn_piped(argv: list[str], env: dict[str, str], *, stdin: bool = False) -> tuple[Forked, Any]:
    """A fork of the :class:`Zygote` running ``argv``, and its output (stdout
    and stderr) as a text file to read line by line (closed by the caller)."""
    read, write = os.pipe()
    try:
        proc = Zygote.get().spawn(argv, env, output=write, stdin=stdin)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return proc, os.fdopen(read, "r")


def spawn_rank(script: str, *args: str, env: dict[str, str]) -> Forked:
    """Start ``tests/ranks/<script>`` as one rank process, a fork of the
    :class:`Zygote`, its output (stdout and stderr) collected."""
    return Zygote.get().spawn([str(RANKS / script), *args], env)


def run_ranks(
    script: str,
    world: int,
    *args: str,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> list[str]:
    """Run ``tests/ranks/<script>`` as ``world`` processes with torch's env://
    variables; fail (killing all) if any exits non-zero or the group overruns
    ``timeout``. Returns each rank's stdout. The processes are forks of the
    :class:`Zygote` unless ``fresh`` (a new interpreter each)."""
    port = free_port()
    procs: list[Any]
    if fresh:
        procs = [
            subprocess.Popen(
                [sys.executable, str(RANKS / script), *args],
                env=rank_env(rank, world, port, **(env or {})),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
    else:
        zygote = Zygote.get()
        procs = [
            zygote.spawn([str(RANKS / script), *args], rank_env(rank, world, port, **(env or {})))
            for rank in range(world)
        ]
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            remaining = max(1.0, deadline - time.monotonic())
            try:
                out, _ = proc.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"rank {rank} of {script} did not finish in {timeout}s"
                ) from None
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {script} exited {proc.returncode}:\n{out}"
    return outputs


def clean_env() -> dict[str, str]:
    """This environment without rendezvous variables, with the repo importable."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERROGRPC_COORDINATOR"):
        env.pop(key, None)
    return env


def run_torchrun(
    nproc: int, *program: str, timeout: float = 110
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --nproc-per-node N <program>`` on a
    free port, output captured."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            *program,
        ],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def backends(world: int, **options: Any) -> list[fg.Backend]:
    """``world`` ranks in this process, each joined by ``fg.init_backend`` on
    its own thread (as separate processes would), on a fresh loopback port."""
    port = free_port()
    with ThreadPoolExecutor(world) as pool:
        return list(
            pool.map(
                lambda r: fg.init_backend(r, world, "127.0.0.1", port, **options), range(world)
            )
        )


def on_ranks(fn: Callable[[int], T], world: int) -> list[T]:
    """``fn(rank)`` for every rank at once, each on its own thread; the
    first exception is raised once all have finished."""
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(fn, range(world)))


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` if
    it does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.005)


async def async_wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """:func:`wait_until` for a coroutine: polls without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(0.005)


def os_threads() -> int:
    """This process's threads as the kernel counts them (native ones too:
    gRPC's, the TCPStore's, OpenMP's), not only Python's."""
    return len(os.listdir("/proc/self/task"))


def os_thread_names() -> dict[str, int]:
    """This process's threads as the kernel counts them, by name (``comm``)."""
    names: dict[str, int] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # ended meanwhile
        names[name] = names.get(name, 0) + 1
    return names


def count_exchanges(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the kind of every all-gather and reduce-scatter that runs in
    one exchange (one_exchange.SmallRunner, or on direct sockets:
    direct.Direct), in this process, from now on."""
    from ferrogrpc.algorithms.direct import Direct
    from ferrogrpc.algorithms.jobs import Job
    from ferrogrpc.algorithms.one_exchange import SmallRunner
    from ferrogrpc.v1 import collective_pb2 as pb

    kinds: list[int] = []
    run = SmallRunner.run
    run_direct = Direct.run

    async def counting(self: SmallRunner) -> None:
        if self.job.kind in (pb.ALL_GATHER, pb.REDUCE_SCATTER):
            kinds.append(self.job.kind)
        await run(self)

    def counting_direct(self: Direct, job: Job) -> tuple[int, int]:
        if job.kind in (pb.ALL_GATHER, pb.REDUCE_SCATTER):
            kinds.append(job.kind)
        return run_direct(self, job)

    monkeypatch.setattr(SmallRunner, "run", counting)
    monkeypatch.setattr(Direct, "run", counting_direct)
    return kinds


def open_fds() -> int:
    """This process's open file descriptors (sockets, memfds, pipes...)."""
    return len(os.listdir("/proc/self/fd"))


class ServedJob:
    """``tests/ranks/serve.py`` as ``world`` real rank processes, driven
    from the test: ``job.command("all_reduce")`` runs it on every rank and
    returns each rank's answer. Each rank's ``address`` and ``pid`` are
    known once the group formed. Use as a context manager (kills what is
    left on exit)."""

    def __init__(self, world: int, timeout: float = 60.0, **env: str) -> None:
        self.port = free_port()
        self.timeout = timeout
        # Forks of the Zygote, each with its stdin and its output a pipe.
        self.procs: list[Forked] = []
        self._outs: list[Any] = []
        self.addresses: list[str] = []
        self.pids: list[int] = []
        try:
            for rank in range(world):
                proc, out = spawn_piped(
                    [str(RANKS / "serve.py")], rank_env(rank, world, self.port, **env), stdin=True
                )
                self.procs.append(proc)
                self._outs.append(out)
            for rank in range(world):
                line = self._line(rank)
                words = line.split()
                if words[:2] != ["READY", str(rank)]:
                    # The whole of what it wrote (a traceback), not its first line.
                    raise AssertionError(f"rank {rank} did not start:\n{line}\n{self._rest(rank)}")
                self.addresses.append(words[2])
                self.pids.append(int(words[3]))
        except BaseException:
            for proc in self.procs:  # no rank is left waiting for the others
                proc.kill()
                proc.wait()
            for out in self._outs:
                out.close()
            raise

    def _rest(self, rank: int) -> str:
        """What rank ``rank`` writes until it exits (killed after 10 s)."""
        proc = self.procs[rank]
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return str(self._outs[rank].read())

    def _line(self, rank: int) -> str:
        import select

        proc, out = self.procs[rank], self._outs[rank]
        ready, _, _ = select.select([out], [], [], self.timeout)
        if not ready:
            raise AssertionError(f"rank {rank} did not answer within {self.timeout}s")
        line = str(out.readline())
        if not line:
            raise AssertionError(f"rank {rank} exited ({proc.wait()})")
        return line.strip()

    def command(self, command: str) -> list[str]:
        """Send every rank ``command``; returns each rank's answer."""
        return self.send([command] * len(self.procs))

    def send(self, commands: list[str]) -> list[str]:
        """Send rank r ``commands[r]``; returns each rank's answer."""
        for proc, command in zip(self.procs, commands, strict=True):
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return [self._line(rank) for rank in range(len(self.procs))]

    def __enter__(self) -> ServedJob:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for out in self._outs:
            out.close()


def memory_of(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of process ``pid`` (Linux)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak(pid: int) -> None:
    """Reset process ``pid``'s peak RSS (VmHWM) to its current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


async def outsider_send(
    address: str,
    messages: list[bytes],
    metadata: tuple[tuple[str, str], ...] = (),
    timeout: float = 5.0,
) -> grpc.StatusCode:
    """Send one Send stream of ``messages`` to a peer as an outsider; return
    the status it ends with.

    Through grpc's synchronous client, in a thread: its asyncio client
    reports INTERNAL ("Internal error from Core") in place of the server's
    status when a write of its own fails because the server already
    answered (grpc/grpc#36066), which a loaded machine makes happen now
    and then (1 in 150 here, beside three CPU burners)."""

    def send() -> grpc.StatusCode:
        with grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", -1)]
        ) as channel:
            call = channel.stream_unary(
                SEND_METHOD,
                request_serializer=_as_is,
                response_deserializer=_as_is,
            )
            try:
                call(iter(messages), metadata=metadata, timeout=timeout)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    return await asyncio.to_thread(send)


def _as_is(b: bytes) -> bytes:
    return b
