"""Rank processes forked from one that imported torch already.

A fresh interpreter's ``import torch`` costs about 2 s of CPU, and the
demo, the benchmarks and the scripts start several rank processes on a
machine whose cores the ranks then share. The first :func:`popen` starts a
*template*: this file run as a program, which imports torch and nothing
else (not ferrogrpc, not grpc: gRPC's threads must not exist in a process
that forks), then forks each rank on request. A rank runs its script (or
``-m`` module) as ``__main__`` with its own argv, environment, working
directory and output, as ``python [-u] script args`` would; torch's thread
count follows its OMP_NUM_THREADS (libgomp read the template's when torch
loaded). The template exits when the process that started it does (its
standard input closes).

What differs from a fresh interpreter: the modules torch imports are
imported already (their import-time settings are the template's), and the
rank's memory starts with the template's pages, shared until written. So a
measurement of a rank's memory from its start (``ru_maxrss``) asks for
``fresh=True``. A command that is not ``python [-u] [-m module] ...`` of
this interpreter runs as a plain subprocess.

Protocol, over a Unix socket: one JSON request (argv, module, cwd, env,
unbuffered) with the child's stdout, stderr and stdin attached
(SCM_RIGHTS); the template answers ``<pid>\\n``, and ``<returncode>\\n``
on the same connection when the child exits (negative: the signal that
ended it, as ``subprocess.Popen.returncode``). The tests' rank processes
are forks of the same template (tests/helpers.py, ``Zygote``).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from typing import IO, Any

# ------------------------------------------------------------------ template


def _child(request: dict[str, Any], fds: list[int]) -> None:
    code = 0
    try:
        for target, fd in enumerate((fds[2], fds[0], fds[1])):  # stdin, stdout, stderr
            os.dup2(fd, target)
        for fd in set(fds):
            os.close(fd)
        os.chdir(str(request["cwd"]))
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        if request.get("unbuffered") or env.get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, io.TextIOWrapper):
                    stream.reconfigure(line_buffering=True, write_through=True)
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        argv = [str(a) for a in request["argv"]]
        module = request.get("module")
        sys.argv = argv
        sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
        for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(1, entry)
        if module:
            runpy.run_module(str(module), run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(pid: int, conn: socket.socket) -> None:
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass
    finally:
        conn.close()


def _watch_parent() -> None:
    # Raw reads: a thread blocked in sys.stdin would hold its lock in every
    # fork, for good.
    while os.read(0, 4096):
        pass
    os._exit(0)  # EOF: the process that started the template is gone


def serve(path: str) -> None:
    """The template: import torch, then fork a child per request on the
    Unix socket ``path`` (see the module docstring)."""
    import torch  # noqa: F401  (the point: imported once, before every fork)

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("READY", flush=True)
    threading.Thread(target=_watch_parent, daemon=True).start()
    while True:
        conn, _ = server.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            _child(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        threading.Thread(target=_reap, args=(pid, conn), daemon=True).start()


# -------------------------------------------------------------------- client


class Fork:
    """A process forked by the :class:`Template`: the part of
    ``subprocess.Popen`` the programs use (pid, returncode, poll, wait,
    send_signal, terminate, kill, communicate, and ``stdout`` when it was
    asked for as a pipe)."""

    def __init__(self, conn: socket.socket, stdout: IO[Any] | None = None) -> None:
        self.stdout = stdout
        self._watch(conn)

    def _watch(self, conn: socket.socket) -> None:
        """Take the pid from the template's answer on ``conn``, and the exit
        status when it comes."""
        self._conn = conn
        self._lines = conn.makefile("r")
        self.pid = int(self._lines.readline())
        self.returncode: int | None = None
        self._exit = threading.Thread(target=self._wait_exit, daemon=True)
        self._exit.start()

    def _wait_exit(self) -> None:
        line = self._lines.readline()
        self.returncode = int(line) if line.strip() else -signal.SIGKILL
        self._conn.close()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._exit.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, None]:
        """Its output to the end (where ``stdout`` is a pipe), once it
        exited."""
        out: list[Any] = []
        if self.stdout is not None:
            stream = self.stdout
            reader = threading.Thread(target=lambda: out.append(stream.read()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0)
        self.wait(timeout)
        return (out[0] if out else None), None


class Template:
    """The template process (see the module docstring), started once per
    process that launches ranks (:meth:`get`)."""

    _started: Template | None = None

    def __init__(self, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        """``env``, ``cwd``: the template's own (this process's by
        default); torch is imported under them."""
        self._dir = tempfile.mkdtemp(prefix="ferrogrpc-template-")
        self.path = os.path.join(self._dir, "sock")
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
            text=True,
        )
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        if ready.strip() != "READY":
            self.close()
            raise RuntimeError(f"the rank template (client/forks.py) did not start: {ready!r}")
        atexit.register(self.close)

    @classmethod
    def get(cls) -> Template:
        if cls._started is None or not cls._started.alive():
            cls._started = cls()
        return cls._started

    def alive(self) -> bool:
        return self._proc.poll() is None

    def request(
        self, request: dict[str, Any], stdout: int, stderr: int, stdin: int
    ) -> socket.socket:
        """Ask for a fork (see the module docstring's protocol); the
        connection its pid and exit status come back on."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(request).encode()], [stdout, stderr, stdin])
        except BaseException:
            conn.close()
            raise
        return conn

    def spawn(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        *,
        stdout: int,
        stderr: int,
        module: str | None = None,
        cwd: str | None = None,
        unbuffered: bool = False,
        pipe: IO[Any] | None = None,
    ) -> Fork:
        """Fork a process running ``argv`` (a script and its arguments; or,
        with ``module``, the module's). ``stdout`` and ``stderr`` are the
        caller's file descriptors (left open); its stdin is /dev/null.
        ``pipe``, the reading end the caller keeps, becomes Fork.stdout."""
        request = {
            "argv": list(argv),
            "module": module,
            "cwd": cwd or os.getcwd(),
            "env": env,
            "unbuffered": unbuffered,
        }
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            conn = self.request(request, stdout, stderr, null)
        finally:
            os.close(null)
        return Fork(conn, pipe)

    def close(self) -> None:
        if self.alive():
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def _parse(command: Sequence[str]) -> tuple[list[str], str | None, bool] | None:
    """(argv, module, unbuffered) of ``python [-u] (script | -m module)
    args`` where python is this interpreter (by path, not resolved: another
    venv's python links to the same binary), or None for any other command."""
    if not command or os.path.abspath(command[0]) != os.path.abspath(sys.executable):
        return None
    rest, unbuffered = list(command[1:]), False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if len(rest) >= 2 and rest[0] == "-m":
        return [rest[1], *rest[2:]], rest[1], unbuffered
    if rest and not rest[0].startswith("-"):
        return rest, None, unbuffered
    return None


def popen(
    command: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    text: bool = False,
    fresh: bool = False,
) -> Fork | subprocess.Popen[Any]:
    """``subprocess.Popen(command, ...)`` for a rank process: a fork of the
    :class:`Template` where ``command`` runs a Python script or module of
    this interpreter, else (or with ``fresh``) a new process. ``stdout`` is
    None (this process's), ``subprocess.PIPE`` or a file; ``stderr`` None
    or ``subprocess.STDOUT``."""
    parsed = None if fresh else _parse(command)
    if parsed is None or stderr not in (None, subprocess.STDOUT):
        return subprocess.Popen(
            list(command), env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text
        )
    argv, module, unbuffered = parsed
    read: int | None = None
    if stdout == subprocess.PIPE:
        read, out = os.pipe()
    elif stdout is None:
        out = os.dup(1)
    else:
        out = os.dup(stdout if isinstance(stdout, int) else stdout.fileno())
    try:
        err = out if stderr == subprocess.STDOUT else 2
        pipe = None if read is None else os.fdopen(read, "r" if text else "rb")
        try:
            return Template.get().spawn(
                argv,
                dict(os.environ if env is None else env),
                stdout=out,
                stderr=err,
                module=module,
                cwd=None if cwd is None else os.fspath(cwd),
                unbuffered=unbuffered,
                pipe=pipe,
            )
        except BaseException:
            if pipe is not None:
                pipe.close()
            raise
    finally:
        os.close(out)


def spawn_ranks(
    world: int, argv: Sequence[str], *, capture: bool = True, **extra: str
) -> list[Fork | subprocess.Popen[Any]]:
    """``ferrogrpc.testing.spawn_ranks`` with :func:`popen`: ``world``
    local ranks of ``argv`` with torchrun's variables on a fresh master
    port, their stdout captured as text when ``capture``."""
    from ferrogrpc.testing import free_port

    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            **dict.fromkeys(("RANK", "LOCAL_RANK"), str(rank)),
            **dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE"), str(world)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            **extra,
        }
        procs.append(popen(argv, env=env, stdout=subprocess.PIPE if capture else None, text=True))
    return procs


if __name__ == "__main__":
    serve(sys.argv[1])
