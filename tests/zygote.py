"""A fork server for the tests' rank processes.

Importing torch costs a rank process about 2 s of CPU, and the suite starts
hundreds of them on 2 cores. The zygote imports torch once; each rank is a
fork of it that runs its script as ``__main__`` with its own argv,
environment, working directory and output pipe. Nothing else is imported
before the fork (not ferrogrpc, not grpc: gRPC's threads must not exist in
a process that forks). The zygote's own threads (one watching its stdin,
one per child waiting for it to exit) hold no lock a child could need.

Protocol, over a Unix socket: the client sends one JSON request (argv, env,
cwd) with the child's output attached (SCM_RIGHTS: the write end of a pipe,
or a file), and optionally its standard input (else /dev/null);
the zygote answers ``<pid>\\n``, and later ``<returncode>\\n`` on the same
connection when the child exits (negative: the signal that ended it, as
``subprocess.Popen.returncode``).

Run by tests/helpers.py (:class:`Zygote`); the zygote exits when its stdin
closes (the test process ended).
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import threading
import traceback


def _child(request: dict[str, object], fds: list[int]) -> None:
    code = 0
    try:
        out = fds[0]
        stdin = fds[1] if len(fds) > 1 else os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(stdin)
        os.chdir(str(request["cwd"]))
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        argv = request["argv"]
        assert isinstance(argv, list)
        sys.argv = [str(a) for a in argv]
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:
                sys.path.insert(1, entry)
        runpy.run_path(sys.argv[0], run_name="__main__")
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
    os._exit(0)  # EOF: the test process is gone


def serve(path: str) -> None:
    import torch  # noqa: F401  (the point: imported once, before every fork)

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("READY", flush=True)
    threading.Thread(target=_watch_parent, daemon=True).start()
    while True:
        conn, _ = server.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
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


if __name__ == "__main__":
    serve(sys.argv[1])
