"""The launch recipes of docs/recipes/ (issue 58, item 4), as far as this
machine can run them: the Kubernetes manifests parse and agree with each
other (ports, names, the coordinator's and torchrun's arguments through
their own parsers); every FERROGRPC_* variable a recipe names exists; the
SLURM script runs on one "node" with stand-ins for srun and scontrol, and
the Kubernetes workers' command trains against a local coordinator. Not
run here: a real SLURM cluster, a real Kubernetes cluster, the Prometheus
Operator."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.run import get_args_parser

from ferrogrpc import env as fg_env
from ferrogrpc.control.serve import build_parser

from .helpers import RANKS, ROOT, clean_env, free_port

RECIPES = ROOT / "docs" / "recipes"
K8S = RECIPES / "k8s"


def _docs(name: str) -> dict[str, dict[str, Any]]:
    """A manifest's documents, by kind (one of each here)."""
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), name
    return by_kind


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _known_variables() -> set[str]:
    return {
        value
        for name, value in vars(fg_env).items()
        if name.endswith("_ENV") and isinstance(value, str)
    }


@pytest.mark.timeout(60)
def test_every_ferrogrpc_variable_a_recipe_names_exists() -> None:
    known = {v for v in _known_variables() if v.startswith("FERROGRPC_")}
    files = [*RECIPES.rglob("*.yaml"), RECIPES / "slurm.sbatch", ROOT / "docs" / "launchers.md"]
    named = {
        (path.name, m)
        for path in files
        for m in re.findall(r"FERROGRPC_[A-Z0-9_]*[A-Z0-9]", path.read_text())
    }
    assert named, files
    unknown = sorted((f, v) for f, v in named if v not in known)
    assert not unknown, unknown
    # And every variable a manifest sets (env:) is one of them.
    for name in ("coordinator.yaml", "workers.yaml"):
        for doc in _docs(name).values():
            if doc["kind"] in ("Deployment", "Job"):
                for var in _container(doc).get("env", []):
                    assert var["name"] in known, (name, var["name"])


@pytest.mark.timeout(60)
def test_the_kubernetes_manifests_parse_and_agree() -> None:
    coordinator = _docs("coordinator.yaml")
    workers = _docs("workers.yaml")
    monitors = _docs("prometheus.yaml")
    assert set(coordinator) == {"Secret", "Deployment", "Service"}
    deployment, service = coordinator["Deployment"], coordinator["Service"]
    # One coordinator, replaced and never doubled.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    box = _container(deployment)
    assert box["command"][:2] == ["ferrogrpc", "coordinator"]
    args = build_parser().parse_args(box["command"][2:])
    ports = {p["name"]: p["containerPort"] for p in box["ports"]}
    assert ports == {"rendezvous": args.port, "metrics": args.metrics_port}
    served = {p["name"]: p for p in service["spec"]["ports"]}
    assert {p["targetPort"] for p in served.values()} <= set(ports)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    token = coordinator["Secret"]["stringData"]["token"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert box[probe]["exec"]["command"] == ["ferrogrpc", "health", f"127.0.0.1:{args.port}"]

    job = workers["Job"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] >= 1
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # (backoffLimitPerIndex's)
    agent = _container(job)
    assert agent["command"][0] == "torchrun"
    run = get_args_parser().parse_args(agent["command"][1:])
    assert run.rdzv_backend == "ferrogrpc" and run.max_restarts > 0
    host, port = run.rdzv_endpoint.rsplit(":", 1)
    assert host == service["metadata"]["name"] and int(port) == served["rendezvous"]["port"]
    low, high = (int(n) for n in run.nnodes.split(":"))
    assert 1 <= low <= high <= spec["completions"]
    assert run.module and run.training_script == "client.train"
    secret_refs = [
        v["valueFrom"]["secretKeyRef"]
        for c in (box, agent)
        for v in c["env"]
        if v["name"] == "FERROGRPC_TOKEN"
    ]
    assert len(secret_refs) == 2
    assert all(r["name"] == coordinator["Secret"]["metadata"]["name"] for r in secret_refs)
    assert token and token == token.strip()
    worker_ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    metrics_env = {v["name"]: v.get("value") for v in agent["env"]}["FERROGRPC_METRICS_PORT"]
    nproc = int(run.nproc_per_node)
    assert sorted(worker_ports.values()) == [int(metrics_env) + i for i in range(nproc)]

    pod_monitor = monitors["PodMonitor"]["spec"]
    assert pod_monitor["selector"]["matchLabels"].items() <= (
        spec["template"]["metadata"]["labels"].items()
    )
    assert {e["port"] for e in pod_monitor["podMetricsEndpoints"]} == set(worker_ports)
    service_monitor = monitors["ServiceMonitor"]["spec"]
    assert service_monitor["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in service_monitor["endpoints"]} <= set(served)
    scrape = yaml.safe_load(monitors["ConfigMap"]["data"]["prometheus.yml"])
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    target = jobs["ferrogrpc-coordinator"]["static_configs"][0]["targets"][0]
    assert target == f"{service['metadata']['name']}:{served['metrics']['port']}"


def _fake_slurm(bin_dir: Path) -> None:
    """srun that runs its command here (its options are all --opt=value),
    and scontrol whose host list is this machine."""
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/bash\necho 127.0.0.1\n")
    for path in (srun, scontrol):
        path.chmod(0o755)


def _trained(tmp: Path, out: str, steps: int, world: int) -> None:
    # The workers share the agent's stdout, and print() writes a line and
    # its newline apart: read each record where it starts.
    decode = json.JSONDecoder().raw_decode
    lines = [decode(out, m.start())[0] for m in re.finditer(r'\{"step"', out)]
    assert sorted({d["step"] for d in lines}) == list(range(steps)), out
    assert {d["world"] for d in lines} == {world}, out
    assert len(list(tmp.glob("final-*.pt"))) == world


@pytest.mark.timeout(180)
def test_the_slurm_recipe_trains_on_one_node_with_stand_ins_for_slurm(tmp_path: Path) -> None:
    _fake_slurm(tmp_path / "bin")
    env = clean_env()
    env.pop("PYTHONPATH")  # the installed package, as on a cluster
    env.update(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
        + env["PATH"],
        SLURM_JOB_NODELIST="node0",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_ID="58",
        TRAIN=str(RANKS / "elastic_train.py"),
        NPROC_PER_NODE="2",
        COORDINATOR_PORT=str(free_port()),
        COORDINATOR_METRICS_PORT="0",
        FERROGRPC_METRICS_PORT="0",
        # elastic_train.py's own settings
        STEPS="6",
        WORLD="2",
        OUT_DIR=str(tmp_path),
    )
    done = subprocess.run(
        ["bash", str(RECIPES / "slurm.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _trained(tmp_path, done.stdout, 6, 2)
    assert "coordinator listening on 0.0.0.0:" in done.stdout


@pytest.mark.timeout(180)
def test_the_kubernetes_workers_command_trains_against_a_coordinator(tmp_path: Path) -> None:
    # The Job's container command, run here: its endpoint is a local
    # coordinator, its pod one "node" (--nnodes=1:1), two steps.
    agent = _container(_docs("workers.yaml")["Job"])
    port = free_port()
    command = [
        arg.replace("ferrogrpc-coordinator:29400", f"127.0.0.1:{port}")
        .replace("--nnodes=2:4", "--nnodes=1:1")
        .replace("--steps=400", "--steps=2")
        for arg in agent["command"]
    ]
    assert command != agent["command"]
    env = clean_env()
    coordinator = subprocess.Popen(
        [
            *(sys.executable, "-m", "ferrogrpc.cli", "coordinator", "--world-size=0"),
            *("--host=127.0.0.1", f"--port={port}", "--join-window=0.5"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *command[1:]],
            cwd=ROOT,  # the image's workdir holds client/
            env={**env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=150,
        )
    finally:
        coordinator.kill()
        coordinator.wait()
    assert done.returncode == 0, shlex.join(command) + "\n" + done.stdout + done.stderr[-3000:]
    assert done.stdout.count('"event": "done"') == 2, done.stdout  # both workers trained
    assert '"world_size": 2' in done.stdout, done.stdout
