"""docker-compose.yml on a real Docker engine: the README's compose commands
build the image from this checkout and run the coordinator and the rank
replicas, each replica a container of its own (its own network namespace:
to the others, another host).

Needs a Docker engine, Debian's docker-compose and the python:3.11-slim base
image, which scripts/docker_setup.sh provides (the README's test command runs
it first). Where no engine answers, these tests fail and say so: they are
never skipped.

Each run has a project name of its own (so its containers and network are
its own) and is always taken down, even when the test fails. The image is
tagged per checkout, so the build cache survives between runs and two
checkouts never run each other's image.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from client.train import build_model, global_batch, make_optimizer
from ferrogrpc.failure.watchdog import PROBE_S, silence_bound
from tests.helpers import ROOT

README = ROOT / "README.md"
RANKS = 4
STEPS = 20  # docker-compose.yml's default FERROGRPC_STEPS
BATCH, LR = 48, 0.01  # client.train's defaults
COORDINATOR_PORT = 29400  # inside the compose network
IMAGE = f"ferrogrpc-test:{hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]}"
BUILD_TIMEOUT_S = 420
# How a user gets what these tests need.
SETUP = "scripts/docker_setup.sh"
ENGINE_HINT = (
    f"run `bash {SETUP}` as root on Debian (it installs docker.io and docker-compose, starts "
    "the engine and provides python:3.11-slim); see docs/troubleshooting.md"
)
CLI = [sys.executable, "-m", "ferrogrpc.cli"]
Record = dict[str, object]


def _readme_compose_commands() -> tuple[list[str], list[str]]:
    """The build and up commands of the README's compose section, as argv."""
    text = README.read_text()
    marker = text.index("<!-- compose-commands -->")
    block = text[marker:].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert len(commands) == 2, f"the README's compose block should be build, then up: {block}"
    build, up = commands
    assert build[-1:] == ["build"] and up[-3:] == ["up", "--scale", f"rank={RANKS}"], commands
    assert build[:-1] == up[:-3], f"build and up must use the same compose: {commands}"
    return build, up


BUILD, UP = _readme_compose_commands()


def _readme_elastic_commands() -> tuple[str, str, str]:
    """The README's elastic compose example, each line as bash runs it: up,
    a docker kill of one replica, then up -d that adds one back."""
    text = README.read_text()
    marker = text.index("<!-- elastic-compose-commands -->")
    block = text[marker:].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    assert len(lines) == 3, f"the README's elastic compose block: up, kill, up -d: {block}"
    up, kill, add = lines
    assert f"up --scale rank={RANKS}" in up and "docker kill" in kill, lines
    assert f"up -d --scale rank={RANKS}" in add, lines
    return up, kill, add


ELASTIC_UP, ELASTIC_KILL, ELASTIC_ADD = _readme_elastic_commands()


def test_the_compose_file_and_the_readme_agree_on_the_replicas() -> None:
    replicas = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["rank"][
        "deploy"
    ]["replicas"]
    assert replicas == RANKS, f"docker-compose.yml runs {replicas} replicas, the README {RANKS}"


def _readme_test_command() -> str:
    """The README's test command, found as .ci/run finds it (the second line
    after its marker)."""
    lines = README.read_text().splitlines()
    return lines[lines.index("<!-- test-command -->") + 2]


def test_the_elastic_example_leaves_time_to_kill_a_replica() -> None:
    # Both up commands name one env file, which makes the group elastic and
    # runs long enough to `docker kill` a replica and add one back (its 20
    # steps took 8 s when the example ran with the compose file's defaults).
    files = [
        shlex.split(c)[shlex.split(c).index("--env-file") + 1] for c in (ELASTIC_UP, ELASTIC_ADD)
    ]
    assert files[0] == files[1], files
    settings = dict(
        line.split("=", 1)
        for line in (ROOT / files[0]).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert settings["FERROGRPC_ELASTIC"] == "1", settings
    assert int(settings["FERROGRPC_STEPS"]) * float(settings["FERROGRPC_STEP_SLEEP"]) >= 60
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERROGRPC_")}
    config = yaml.safe_load(_run([*COMPOSE, "--env-file", files[0], "config"], env=env))
    rank = config["services"]["rank"]
    assert rank["environment"]["FERROGRPC_ELASTIC"] == "1", rank["environment"]
    assert (
        rank["command"][rank["command"].index("--step-sleep") + 1]
        == settings["FERROGRPC_STEP_SLEEP"]
    )


def test_the_readme_test_command_sets_up_docker_with_the_projects_own_script() -> None:
    # The test command needs an engine and python:3.11-slim; it gets them as
    # the demo command gets its own set-up, from a script of this project
    # (not from the CI machines' ../shared), which CI runs through it.
    command = _readme_test_command()
    assert command.startswith(f"bash {SETUP} && "), command
    script = ROOT / SETUP
    assert script.is_file(), script
    subprocess.run(["bash", "-n", str(script)], check=True)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in ci and 'bash -c "$test_cmd"' in ci, ci
    for text in (script.read_text(), ci):
        assert "../shared" not in text and "docker-base" not in text
    assert SETUP in (ROOT / "docs" / "troubleshooting.md").read_text()


@pytest.mark.timeout(300)
def test_docker_setup_leaves_a_ready_host_as_it_is() -> None:
    # The README's test command runs it every time: where the engine runs
    # and the base image is here, it does nothing, quietly.
    proc = subprocess.run(
        ["bash", SETUP], cwd=ROOT, capture_output=True, text=True, timeout=280, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _engine_problem() is None
    _run(["docker", "image", "inspect", "python:3.11-slim"])
    assert proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


COMPOSE = BUILD[:-1]  # the compose program itself, for `port`, `down`


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """Run ``argv`` in the repository root; its stdout, or a failure with its output."""
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{shlex.join(argv)} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def _engine_problem() -> str | None:
    """Why compose cannot run here, or None."""
    for exe in ("docker", COMPOSE[0]):
        if shutil.which(exe) is None:
            return f"{exe} is not installed"
    try:
        proc = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer `docker info` within 30 s"
    if proc.returncode != 0:
        return f"no Docker engine answers ({(proc.stderr or proc.stdout).strip()})"
    return None


@dataclasses.dataclass(frozen=True)
class Image:
    tag: str
    build_seconds: float


@pytest.fixture(scope="module")
def image() -> Image:
    """The README's build command, run once for this module."""
    problem = _engine_problem()
    if problem is not None:
        pytest.fail(
            f"the compose tests need a Docker engine: {problem}. To get one, {ENGINE_HINT}."
        )
    env = {**os.environ, "FERROGRPC_IMAGE": IMAGE}
    start = time.monotonic()
    proc = subprocess.run(
        BUILD, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    if proc.returncode != 0:
        base = subprocess.run(
            ["docker", "image", "inspect", "python:3.11-slim"], capture_output=True, check=False
        )
        hint = (
            f" (the base image python:3.11-slim is not here: run `bash {SETUP}`, "
            "see docs/troubleshooting.md)"
            if base.returncode
            else ""
        )
        pytest.fail(f"{shlex.join(BUILD)} failed{hint}:\n{proc.stdout[-6000:]}{proc.stderr}")
    seconds = time.monotonic() - start
    user = _run(["docker", "image", "inspect", "--format", "{{.Config.User}}", IMAGE]).strip()
    assert user not in ("", "root", "0"), f"the image runs as root ({user!r})"
    return Image(IMAGE, seconds)


class Project:
    """One compose project, started with the README's up command."""

    def __init__(self, name: str, env: dict[str, str], log: Path) -> None:
        self.name = name
        self.env = env
        self.log = log
        self.up: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str] | None = None) -> None:
        """Run ``argv`` (default: the README's up command) in the background."""
        with self.log.open("wb") as out:
            self.up = subprocess.Popen(
                argv or UP, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )

    def output(self) -> str:
        """What `up` printed so far (its tail), for failure messages."""
        return self.log.read_text(errors="replace")[-8000:]

    def containers(self, service: str) -> list[str]:
        ids = _run(
            [
                "docker",
                "ps",
                "-aq",
                # (Full ids: see _inspect.)
                "--no-trunc",
                "--filter",
                f"label=com.docker.compose.project={self.name}",
                "--filter",
                f"label=com.docker.compose.service={service}",
            ]
        )
        return ids.split()

    def wait_for(
        self, what: str, timeout: float, check: Callable[[], object], interval: float = 0.25
    ) -> object:
        """Poll ``check`` until it returns something true, failing after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            assert self.up is not None
            if self.up.poll() is not None:
                value = check()  # up returns once everything ended: look once more
                if value:
                    return value
            if time.monotonic() > deadline or self.up.poll() is not None:
                pytest.fail(
                    f"{what}: not within {timeout:g}s. compose up printed:\n{self.output()}"
                )
            time.sleep(interval)

    def _remaining(self) -> dict[str, list[str]]:
        """This project's containers and networks that still exist, by the
        docker command that removes them."""
        label = f"label=com.docker.compose.project={self.name}"
        return {
            "rm -f -v": _run(["docker", "ps", "-aq", "--filter", label]).split(),
            "network rm": _run(["docker", "network", "ls", "-q", "--filter", label]).split(),
        }

    def leftovers(self) -> list[str]:
        """Containers and networks of this project that still exist."""
        return [i for ids in self._remaining().values() for i in ids]

    def force_remove(self) -> None:
        """Remove whatever of this project still exists, running or not."""
        for rm, ids in self._remaining().items():
            if ids:
                subprocess.run(
                    ["docker", *rm.split(), *ids], capture_output=True, timeout=120, check=False
                )

    def down(self) -> None:
        subprocess.run(
            [*COMPOSE, "down", "-v", "--remove-orphans", "--timeout", "5"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            timeout=120,
            check=False,
        )
        if self.up is not None:
            try:
                self.up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.up.kill()
                self.up.wait()


@contextlib.contextmanager
def compose_project(image: Image, tmp_path: Path, **variables: str) -> Iterator[Project]:
    """A project with a unique name, the coordinator's port published on a
    port Docker picks, and ``variables`` for compose; always taken down."""
    name = f"fgtest{os.getpid()}{secrets.token_hex(3)}"
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": name,
        "FERROGRPC_IMAGE": image.tag,
        "FERROGRPC_PUBLISH_PORT": "0",
        **variables,
    }
    project = Project(name, env, tmp_path / "compose-up.log")
    ok = False
    try:
        yield project
        ok = True
    finally:
        project.down()
        left = project.leftovers()
        if left:
            # `up` may still have been creating containers when `down` ran
            # (a test that failed early): nothing of the project may outlive
            # the test, or its replicas train on beside the rest of the suite.
            project.force_remove()
        if ok:  # on a failure, its own message matters more
            assert not left, f"`down` left containers or networks of {name}: {left}"


def _inspect(container: str, wait: float = 10.0) -> dict[str, object]:
    """``docker inspect`` of a container that ``docker ps`` listed. The
    engine can list a container it is still creating before inspect finds
    it ("No such object": seen once in a full run, right after ``up``
    began); that answer is retried for up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        proc = subprocess.run(
            ["docker", "inspect", container], capture_output=True, text=True, timeout=60
        )
        if proc.returncode == 0:
            data: list[dict[str, object]] = json.loads(proc.stdout)
            return data[0]
        if "No such object" not in proc.stderr or time.monotonic() > deadline:
            raise AssertionError(f"docker inspect {container} failed:\n{proc.stdout}{proc.stderr}")
        time.sleep(0.25)


def _state(container: str) -> dict[str, object]:
    state: dict[str, object] = _inspect(container)["State"]  # type: ignore[assignment]
    return state


def _logs(container: str, timestamps: bool = False) -> str:
    proc = subprocess.run(
        ["docker", "logs", *(["-t"] if timestamps else []), container],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return proc.stdout + proc.stderr


def _records(log: str) -> list[Record]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def _joined(log: str) -> Record:
    return next(r for r in _records(log) if r.get("event") == "joined")


def _time(stamp: str) -> float:
    """Docker's RFC 3339 time (nanoseconds) as seconds since the epoch."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    whole = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC)
    return whole.timestamp() + float(f"0.{frac or 0}")


def _published(project: Project, service: str, port: int) -> int:
    def find() -> str:
        proc = subprocess.run(
            [*COMPOSE, "port", service, str(port)],
            cwd=ROOT,
            env=project.env,
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout.strip() if proc.returncode == 0 else ""

    return int(str(project.wait_for(f"{service}'s published port", 60, find)).rsplit(":")[-1])


def _published_port(project: Project) -> int:
    """The host port Docker published the coordinator's on."""
    return _published(project, "coordinator", COORDINATOR_PORT)


def _wait_healthy(project: Project) -> float:
    """Wait for the coordinator's healthcheck to report healthy; seconds taken."""
    start = time.monotonic()
    found = project.wait_for("the coordinator", 60, lambda: project.containers("coordinator"))
    coordinator = found[0]  # type: ignore[index]

    def healthy() -> bool:
        health = _state(coordinator).get("Health") or {}
        return health.get("Status") == "healthy"  # type: ignore[union-attr]

    project.wait_for("the coordinator's healthcheck to turn healthy", 90, healthy)
    return time.monotonic() - start


def _status_rows(target: str, token: str) -> list[tuple[int, str]]:
    """``ferrogrpc status`` from the host, presenting the job's token (the
    coordinator refuses a status call without it): its (rank, address) rows
    once it says every member joined, else []."""
    env = {**os.environ, "FERROGRPC_TOKEN": token}
    proc = subprocess.run(
        [*CLI, "status", target], capture_output=True, text=True, timeout=30, check=False, env=env
    )
    if proc.returncode != 0 or f"{RANKS}/{RANKS} joined" not in proc.stdout:
        return []
    return [
        (int(m.group(1)), m.group(2))
        for m in re.finditer(r"^\s*(\d+)\s+(\S+:\d+)\s", proc.stdout, re.MULTILINE)
    ]


def _replicas_done(project: Project) -> list[str]:
    ids = project.containers("rank")
    if len(ids) == RANKS and all(_state(c)["Status"] == "exited" for c in ids):
        return ids
    return []


def _reference_losses() -> list[float]:
    """client.train's run as one process on the whole batch, in plain torch:
    the global loss of each step (the ranks' mean of equal slices' losses),
    after gradients averaged over the slices (the whole batch's gradient)."""
    model = build_model()
    opt = make_optimizer(model.parameters(), LR)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, BATCH)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.timeout(BUILD_TIMEOUT_S + 240)
def test_readme_compose_up_scale_4_trains_over_grpc(
    image: Image, tmp_path: Path, report: Callable[[str], None]
) -> None:
    report(f"compose: `{shlex.join(BUILD)}` took {image.build_seconds:.1f}s")
    token = secrets.token_hex(16)
    with compose_project(image, tmp_path, FERROGRPC_TOKEN=token) as project:
        project.start()
        report(f"compose: coordinator healthy after {_wait_healthy(project):.1f}s")
        target = f"127.0.0.1:{_published_port(project)}"
        members = project.wait_for(
            f"`ferrogrpc status {target}` listing {RANKS} members",
            120,
            lambda: _status_rows(target, token),
            interval=0.5,
        )
        # Without the token, the coordinator answers nothing.
        env = {k: v for k, v in os.environ.items() if k != "FERROGRPC_TOKEN"}
        bare = subprocess.run(
            [*CLI, "status", target], capture_output=True, text=True, timeout=30, env=env
        )
        assert bare.returncode != 0 and "joined" not in bare.stdout, (bare.stdout, bare.stderr)
        replicas = project.wait_for(
            f"{RANKS} replicas to exit", 150, lambda: _replicas_done(project), interval=0.5
        )
        logs = {c: _logs(c) for c in replicas}  # type: ignore[union-attr]
        states = {c: _state(c) for c in logs}
        envs = {c: _inspect(c)["Config"]["Env"] for c in logs}  # type: ignore[index]
        # The coordinator ends once every rank has left, so `up` returns.
        assert project.up is not None
        try:
            returned = project.up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`up` did not return after training ended:\n{project.output()}")
        assert returned == 0, project.output()

    for c, log in logs.items():
        assert states[c]["ExitCode"] == 0, f"replica {c} exited {states[c]['ExitCode']}:\n{log}"
        # compose passes the token from the environment to every rank, which
        # then refuses peer RPCs without it: they trained, so all carried it.
        assert f"FERROGRPC_TOKEN={token}" in envs[c], envs[c]
    joined = {int(_joined(log)["rank"]): _joined(log) for log in logs.values()}  # type: ignore[call-overload]
    assert sorted(joined) == list(range(RANKS)), f"ranks {sorted(joined)}: {joined}"
    assert all(j["world_size"] == RANKS for j in joined.values()), joined
    # Every replica is its own host: no shared memory between containers.
    assert {j["path"] for j in joined.values()} == {"grpc"}, joined
    addresses = {str(j["address"]) for j in joined.values()}
    assert len({a.rsplit(":", 1)[0] for a in addresses}) == RANKS, addresses
    # The coordinator's member table, read from the host, names the same ranks.
    assert sorted(members) == sorted((r, str(j["address"])) for r, j in joined.items()), members  # type: ignore[arg-type]

    reference = _reference_losses()
    losses: dict[int, list[float]] = {}
    checksums: dict[int, list[float]] = {}
    for log in logs.values():
        records = [r for r in _records(log) if "loss" in r]
        assert [r["step"] for r in records] == list(range(STEPS)), log
        rank = int(records[0]["rank"])  # type: ignore[call-overload]
        losses[rank] = [float(r["loss"]) for r in records]  # type: ignore[arg-type]
        checksums[rank] = [float(r["checksum"]) for r in records]  # type: ignore[arg-type]
    for step in range(STEPS):
        values = {losses[r][step] for r in range(RANKS)}
        assert len(values) == 1, f"the ranks' losses differ at step {step}: {values}"
        sums = {checksums[r][step] for r in range(RANKS)}
        assert len(sums) == 1, f"the ranks' parameters differ after step {step}: {sums}"
    # Logged rounded to 1e-10; the ring sums in another order than one process.
    torch.testing.assert_close(
        torch.tensor(losses[0], dtype=torch.float64),
        torch.tensor(reference, dtype=torch.float64),
        atol=1e-8,
        rtol=0,
    )


VICTIM = 2
# A kill mid-collective is named at once (the victim's streams end); one
# between collectives by the liveness probe: a killed container's address
# swallows connection attempts, which looks like a slow link until the
# silence has lasted watchdog.silence_bound of the idle timeout (30 s in
# docker-compose.yml): see [Note: liveness probe].
DETECT_S = PROBE_S + silence_bound(30.0) + 3.0
ERROR_LINE = re.compile(r"^(\S+) ferrogrpc\.errors\.(\w+): (.*)$", re.MULTILINE)


@pytest.mark.timeout(BUILD_TIMEOUT_S + 240)
def test_docker_kill_of_a_replica_is_named_by_every_other_in_time(
    image: Image, tmp_path: Path, report: Callable[[str], None]
) -> None:
    # A long run with an exact world size; the victim is killed mid-run.
    variables = {"FERROGRPC_WORLD_SIZE": str(RANKS), "FERROGRPC_STEPS": "1000000"}
    with compose_project(image, tmp_path, **variables) as project:
        project.start()
        _wait_healthy(project)

        def training() -> dict[int, str]:
            ids = project.containers("rank")
            logs = {c: _logs(c) for c in ids}
            if len(ids) < RANKS or not all('"step": 5,' in log for log in logs.values()):
                return {}
            return {int(_joined(log)["rank"]): c for c, log in logs.items()}  # type: ignore[call-overload]

        by_rank: dict[int, str] = project.wait_for(  # type: ignore[assignment]
            "every replica past step 5", 150, training, interval=0.5
        )
        victim = by_rank[VICTIM]
        victim_address = str(_joined(_logs(victim))["address"])
        _run(["docker", "kill", victim])
        project.wait_for(
            "every replica to exit after the kill", 60, lambda: _replicas_done(project)
        )
        # Nothing of the job is left running: every replica has exited.
        running = [c for c in project.containers("rank") if _state(c)["Running"]]
        assert not running, running
        states = {r: _state(c) for r, c in by_rank.items()}
        logs = {r: _logs(c, timestamps=True) for r, c in by_rank.items()}

    assert states[VICTIM]["ExitCode"] == 137, states[VICTIM]
    killed_at = _time(str(states[VICTIM]["FinishedAt"]))
    for rank, state in states.items():
        if rank == VICTIM:
            continue
        log = logs[rank]
        exited = _time(str(state["FinishedAt"])) - killed_at
        errors = ERROR_LINE.findall(log)
        assert errors, f"rank {rank} printed no ferrogrpc error:\n{log[-4000:]}"
        stamp, kind, message = errors[-1]
        named = _time(stamp) - killed_at
        report(
            f"compose: docker kill of rank {VICTIM}: rank {rank} raised {kind} after "
            f"{named:.2f}s, exited {state['ExitCode']} after {exited:.2f}s"
        )
        assert state["ExitCode"] not in (0, None), f"rank {rank} exited {state['ExitCode']}"
        assert kind == "PeerError", message
        assert f"peer {VICTIM} ({victim_address})" in message, message
        assert exited < DETECT_S, f"rank {rank} exited {exited:.2f}s after the kill: {message}"


# docker-compose.yml's `monitoring` profile (issue 32): Prometheus, from
# Debian's package (docker/prometheus/), finds every rank replica through
# Docker's DNS and scrapes it and the coordinator. The elastic test below
# runs with it and asks Prometheus's query API for every rank's series.
PROMETHEUS_IMAGE = IMAGE.replace("ferrogrpc-test", "ferrogrpc-prometheus-test")
PROMETHEUS_BUILD_TIMEOUT_S = 300
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"
MONITORING = {
    "COMPOSE_PROFILES": "monitoring",
    "FERROGRPC_PROMETHEUS_IMAGE": PROMETHEUS_IMAGE,
    "FERROGRPC_PROMETHEUS_PORT": "0",
}


def test_prometheus_scrapes_the_ports_compose_serves_metrics_on() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    rank_sd = jobs["ferrogrpc-rank"]["dns_sd_configs"][0]
    assert rank_sd["names"] == ["rank"] and rank_sd["type"] == "A"
    assert str(rank_sd["port"]) == services["rank"]["environment"]["FERROGRPC_METRICS_PORT"]
    command = services["coordinator"]["command"]
    port = command[command.index("--metrics-port") + 1]
    assert jobs["ferrogrpc-coordinator"]["static_configs"][0]["targets"] == [f"coordinator:{port}"]
    assert services["prometheus"]["profiles"] == ["monitoring"]


def _build_prometheus(project: Project) -> None:
    build = subprocess.run(
        [*COMPOSE, "build", "prometheus"],
        cwd=ROOT,
        env=project.env,
        capture_output=True,
        text=True,
        timeout=PROMETHEUS_BUILD_TIMEOUT_S,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]


class Prometheus:
    """The project's Prometheus, asked at every poll of the test's waits:
    what it last held of each series, kept (a series goes stale once its
    replica is gone)."""

    def __init__(self, port: int) -> None:
        self.port = port
        # By query: every answer, as {rank label ("?": none): value}.
        self.seen: dict[str, list[dict[str, float]]] = {}

    def query(self, promql: str) -> list[dict[str, object]]:
        """An instant query's result vector ([] while Prometheus is not answering)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.load(response)
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            return []
        assert body["status"] == "success", body
        result: list[dict[str, object]] = body["data"]["result"]
        return result

    def poll(self, *queries: str) -> None:
        """Ask each query once; keep each answer as {rank: value}."""
        for promql in queries:
            answer = {
                str(s["metric"].get("rank", "?")): float(s["value"][1])  # type: ignore[attr-defined, index]
                for s in self.query(promql)
            }
            if answer:
                self.seen.setdefault(promql, []).append(answer)


@pytest.mark.timeout(BUILD_TIMEOUT_S + PROMETHEUS_BUILD_TIMEOUT_S + 300)
def test_elastic_compose_survives_a_docker_kill_and_a_scaled_up_replica_joins(
    image: Image, tmp_path: Path, report: Callable[[str], None]
) -> None:
    # README, "Elastic training", its three compose lines as written: up
    # --scale rank=4; docker kill of one replica mid-run, the other three go
    # on; up -d --scale rank=4 again, which recreates none of the three (it
    # did, ending the run, when the README's first line alone set
    # FERROGRPC_ELASTIC=1), and a replica joins. Every step, every member
    # logs the same loss and parameter checksum. With the monitoring
    # profile: Prometheus holds a series from every rank, and sees the
    # membership epoch move. FERROGRPC_ELASTIC comes from the README's
    # words alone; the shell below sets the same run length and pace for
    # every command, shorter than the example's.
    steps = 120
    variables = {
        "FERROGRPC_WORLD_SIZE": str(RANKS),
        "FERROGRPC_STEPS": str(steps),
        "FERROGRPC_STEP_SLEEP": "0.05",
        # 5 s, not the default 2 s: with the suite's three workers, six
        # containers and another test's ranks share 2 cores, and once a
        # replica starved past 2 s during start-up was removed (a false
        # removal this test does not look for); its re-join then livelocked
        # the group in recovery epochs, an issue-30 defect recorded in
        # BENCHMARKS.md ("Elastic training") for its own test.
        "FERROGRPC_HEARTBEAT_TIMEOUT": "5",
        **MONITORING,
    }
    collectives = 'ferrogrpc_collectives_total{job="ferrogrpc-rank",outcome="done"}'
    epoch = 'ferrogrpc_membership_epoch{job="ferrogrpc-rank"}'
    world = 'ferrogrpc_world_size{job="ferrogrpc-rank"}'
    members = 'ferrogrpc_group_members{job="ferrogrpc-coordinator"}'
    with compose_project(image, tmp_path, **variables) as project:
        project.env.pop("FERROGRPC_ELASTIC", None)
        _build_prometheus(project)
        project.start(["bash", "-c", ELASTIC_UP])
        _wait_healthy(project)
        prometheus = Prometheus(_published(project, "prometheus", 9090))

        def records() -> list[Record]:
            prometheus.poll(collectives, epoch, world, members)
            return [r for c in project.containers("rank") for r in _records(_logs(c))]

        def training() -> list[str]:
            prometheus.poll(collectives, epoch, world, members)
            ids = project.containers("rank")
            ok = len(ids) == RANKS and all('"step": 5,' in _logs(c) for c in ids)
            return ids if ok else []

        project.wait_for("every replica past step 5", 150, training, interval=0.5)
        _run(["bash", "-c", ELASTIC_KILL], env=project.env)
        killed_at = time.time()
        started = {c: _state(c) for c in project.containers("rank")}
        survivors = {c: st["StartedAt"] for c, st in started.items() if st["Running"]}
        assert len(survivors) == RANKS - 1, started
        project.wait_for(
            "the other replicas training with 3",
            60,
            lambda: any(r.get("world_size") == RANKS - 1 for r in records()),
        )
        smaller = time.time() - killed_at
        _run(["bash", "-c", ELASTIC_ADD], env=project.env, timeout=120)
        # The running replicas are the same containers, never restarted.
        now = {c: _state(c) for c in project.containers("rank")}
        kept = {c: st["StartedAt"] for c, st in now.items() if c in survivors and st["Running"]}
        after = {c: (st["StartedAt"], st["Running"]) for c, st in now.items()}
        assert kept == survivors, (
            f"`{ELASTIC_ADD}` recreated or restarted running replicas: "
            f"before {survivors}, after {after}"
        )
        grown = project.wait_for(
            "a replica joining the 3",
            120,
            lambda: [
                r
                for r in records()
                if r.get("world_size") == RANKS and int(r.get("epoch", 0)) > 2  # type: ignore[call-overload]
            ],
        )

        def regrown_in_prometheus() -> bool:
            prometheus.poll(collectives, epoch, world, members)
            return any(
                len(a) == RANKS and min(a.values()) > first_epoch
                for a in prometheus.seen.get(epoch, [])
            )

        first_epoch = min(min(a.values()) for a in prometheus.seen.get(epoch, [{"?": 1.0}]))
        project.wait_for("Prometheus to see the regrown group's epoch", 60, regrown_in_prometheus)
        project.wait_for(
            "the run to end",
            240,
            lambda: all(_state(c)["Status"] == "exited" for c in project.containers("rank")),
            interval=0.5,
        )
        logs = {c: _logs(c) for c in project.containers("rank")}
        states = {c: _state(c) for c in logs}

    by_step: dict[int, set[tuple[object, object]]] = {}
    worlds: dict[int, set[object]] = {}
    for log in logs.values():
        for r in _records(log):
            if "step" in r:
                by_step.setdefault(int(r["step"]), set()).add((r["loss"], r["checksum"]))  # type: ignore[call-overload]
                worlds.setdefault(int(r["step"]), set()).add(r["world_size"])  # type: ignore[call-overload]
    assert sorted(by_step) == list(range(steps)), sorted(by_step)
    differing = {s: v for s, v in by_step.items() if len(v) != 1}
    assert not differing, f"members differ at steps {sorted(differing)[:5]}"
    assert {RANKS - 1, RANKS} <= {w for ws in worlds.values() for w in ws}
    finished = [c for c, st in states.items() if st["ExitCode"] == 0]
    assert len(finished) >= RANKS, {c: st["ExitCode"] for c, st in states.items()}
    # The three that went on through the kill and the addition trained to the end.
    for c in survivors:
        last = max(int(r["step"]) for r in _records(logs[c]) if "step" in r)  # type: ignore[call-overload]
        assert states[c]["ExitCode"] == 0 and last == steps - 1, (c, last, states[c])
    first_joined = min(int(r["step"]) for r in grown)  # type: ignore[call-overload]
    # Prometheus held a series from each of the 4 ranks, counting
    # collectives, with the world size; the coordinator's member count; and
    # every rank of the regrown group at a later epoch than the first.
    full = [a for a in prometheus.seen.get(collectives, []) if len(a) == RANKS]
    assert full and set(full[0]) == {str(r) for r in range(RANKS)}, prometheus.seen
    assert all(v > 0 for v in full[0].values()), full[0]
    assert any(sorted(a.values()) == [RANKS] * RANKS for a in prometheus.seen.get(world, []))
    assert {"?": RANKS} in prometheus.seen.get(members, []), prometheus.seen.get(members)
    report(
        f"compose elastic: docker kill of a replica, the others trained with "
        f"{RANKS - 1} within {smaller:.2f}s; the replica added by up -d --scale rank={RANKS} "
        f"trained from step {first_joined}; {steps} steps, members identical at every step; "
        f"Prometheus scraped all {RANKS} ranks, epochs {first_epoch:g} then later"
    )
