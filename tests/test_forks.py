"""client/forks.py: a rank process forked from the template runs its script
or module as a new interpreter would, with its own argv, environment,
working directory, thread count and exit status."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.forks import Fork, popen
from tests.helpers import ROOT

PROGRAM = """
import json, os, sys, torch
print(json.dumps({"argv": sys.argv, "name": __name__, "env": os.environ.get("FORK_TEST"),
                  "cwd": os.getcwd(), "threads": torch.get_num_threads(),
                  "path0": sys.path[0]}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if "--hang" in sys.argv:
    import time
    time.sleep(60)
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.mark.timeout(60)
def test_a_forked_script_gets_its_argv_env_cwd_threads_and_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    env = {"FORK_TEST": "yes", "CODE": "3", "OMP_NUM_THREADS": "3", "PATH": "/usr/bin:/bin"}
    proc = popen(
        [sys.executable, "-u", str(script), "a", "b"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert isinstance(proc, Fork)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3, out
    seen = json.loads(out.splitlines()[0])
    assert seen == {
        "argv": [str(script), "a", "b"],
        "name": "__main__",
        "env": "yes",
        "cwd": str(tmp_path),
        "threads": 3,
        "path0": str(tmp_path),
    }, seen
    assert "to stderr" in out


@pytest.mark.timeout(60)
def test_a_forked_module_runs_as_main_and_a_kill_is_its_exit_status(tmp_path: Path) -> None:
    pkg = tmp_path / "forkpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "prog.py").write_text(PROGRAM)
    log = tmp_path / "out.log"
    with log.open("wb") as f:
        proc = popen(
            [sys.executable, "-m", "forkpkg.prog", "--hang"],
            env={"PYTHONPATH": str(tmp_path)},
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    assert isinstance(proc, Fork) and proc.stdout is None
    deadline = time.monotonic() + 30
    while "\n" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()  # (it sleeps)
    seen = json.loads(log.read_text().splitlines()[0])
    assert seen["argv"][0].endswith("prog.py") and seen["argv"][1:] == ["--hang"], seen
    assert seen["name"] == "__main__" and seen["path0"] == str(ROOT), seen
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_other_commands_and_fresh_run_as_new_processes(tmp_path: Path) -> None:
    echo = popen(["echo", "hi"], stdout=subprocess.PIPE, text=True)
    assert isinstance(echo, subprocess.Popen)
    assert echo.communicate(timeout=10)[0] == "hi\n"
    script = tmp_path / "one.py"
    script.write_text("print(1)")
    for command, fresh in (
        ([sys.executable, "-c", "print(1)"], False),
        ([sys.executable, str(script)], True),
    ):
        proc = popen(command, stdout=subprocess.PIPE, text=True, fresh=fresh)
        assert isinstance(proc, subprocess.Popen), command
        assert proc.communicate(timeout=30)[0] == "1\n"
