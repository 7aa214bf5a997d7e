"""docker-compose.yml's ``monitoring`` profile on a real Docker engine (issue
32): Prometheus (Debian's package, docker/prometheus/) finds every rank
replica through Docker's DNS and scrapes it and the coordinator; the test
asks Prometheus's HTTP API for a ferrogrpc series from every rank.

It reuses test_compose.py's image (the same tag: the build is cached) and
its project helpers: a project of its own, always taken down.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tests.test_compose import (
    COMPOSE,
    IMAGE,
    RANKS,
    Image,
    Project,
    compose_project,
    image,  # noqa: F401 - the module's fixture, shared
)

PROMETHEUS_IMAGE = IMAGE.replace("ferrogrpc-test", "ferrogrpc-prometheus-test")
PROMETHEUS_BUILD_TIMEOUT_S = 300
CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"


def test_prometheus_scrapes_the_ports_compose_serves_metrics_on() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    config = yaml.safe_load(CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    rank_sd = jobs["ferrogrpc-rank"]["dns_sd_configs"][0]
    assert rank_sd["names"] == ["rank"] and rank_sd["type"] == "A"
    assert str(rank_sd["port"]) == services["rank"]["environment"]["FERROGRPC_METRICS_PORT"]
    command = services["coordinator"]["command"]
    port = command[command.index("--metrics-port") + 1]
    assert jobs["ferrogrpc-coordinator"]["static_configs"][0]["targets"] == [f"coordinator:{port}"]
    assert services["prometheus"]["profiles"] == ["monitoring"]


def _query(port: int, promql: str) -> list[dict[str, object]]:
    """An instant query's result vector ([] while Prometheus is not answering)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
    except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
        return []
    assert body["status"] == "success", body
    result: list[dict[str, object]] = body["data"]["result"]
    return result


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

    return int(str(project.wait_for(f"{service}'s published port", 90, find)).rsplit(":")[-1])


@pytest.mark.timeout(PROMETHEUS_BUILD_TIMEOUT_S + 420)
def test_prometheus_in_compose_scrapes_every_rank(
    image: Image,  # noqa: F811
    tmp_path: Path,
    report: Callable[[str], None],
) -> None:
    variables = {
        "COMPOSE_PROFILES": "monitoring",
        "FERROGRPC_PROMETHEUS_IMAGE": PROMETHEUS_IMAGE,
        "FERROGRPC_PROMETHEUS_PORT": "0",
        # Long enough to be scraped; the project is taken down once it was.
        "FERROGRPC_STEPS": "2000",
        "FERROGRPC_STEP_SLEEP": "0.05",
    }
    with compose_project(image, tmp_path, **variables) as project:
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
        project.start()
        port = _published(project, "prometheus", 9090)

        def every_rank() -> list[dict[str, object]]:
            found = _query(port, 'ferrogrpc_collectives_total{job="ferrogrpc-rank",outcome="done"}')
            ranks = {s["metric"]["rank"] for s in found}  # type: ignore[index]
            return found if ranks == {str(r) for r in range(RANKS)} else []

        series = project.wait_for(
            f"Prometheus to hold a ferrogrpc series from each of the {RANKS} ranks",
            180,
            every_rank,
            interval=1.0,
        )
        # One replica (its own address) per rank, each counting collectives.
        instances = {s["metric"]["instance"] for s in series}  # type: ignore[index, union-attr]
        assert len(instances) == RANKS, series
        assert all(float(s["value"][1]) > 0 for s in series), series  # type: ignore[index]
        world = _query(port, 'ferrogrpc_world_size{job="ferrogrpc-rank"}')
        assert sorted(float(s["value"][1]) for s in world) == [RANKS] * RANKS, world  # type: ignore[index]
        group = project.wait_for(
            "the coordinator's group metrics in Prometheus",
            30,
            lambda: _query(port, 'ferrogrpc_group_members{job="ferrogrpc-coordinator"}'),
        )
        assert [float(s["value"][1]) for s in group] == [RANKS], group  # type: ignore[index, union-attr]
        report(f"compose monitoring: Prometheus scraped {RANKS} ranks at {sorted(instances)}")
