"""torchrun's ferrogrpc rendezvous (control/torchrun.py) on its own: its
registration through the ``torchrun.handlers`` entry point, what it exports
to the workers, the agents' two restart rules kept apart (see [Note: two
restart rules]), a group that ended closing it, and the settings the workers
derive from ``--nnodes``. The real processes are in test_torchrun.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

import ferrogrpc as fg
from ferrogrpc.control.coordinator import Coordinator
from ferrogrpc.control.rounds import QuorumLostInRound
from ferrogrpc.control.torchrun import FerroGrpcRendezvousHandler, parse_endpoint
from ferrogrpc.env import Settings
from ferrogrpc.v1 import rendezvous_pb2 as rpb

from .helpers import clean_env, free_port

pytestmark = pytest.mark.timeout(60)


class Served:
    """A coordinator on an event loop of its own thread, as a separate
    process would be (the handler is blocking code)."""

    def __init__(self, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coordinator = self.call(self._make(options))
        self.port = self.call(self.coordinator.start("127.0.0.1:0"))
        self.target = f"127.0.0.1:{self.port}"

    @staticmethod
    async def _make(options: dict[str, Any]) -> Coordinator:
        return Coordinator(0, join_window=0.1, **options)

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def close(self) -> None:
        self.call(self.coordinator.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(min_ranks=2, heartbeat_timeout=30.0)
    s.coordinator.membership.quiet = 0
    try:
        yield s
    finally:
        s.close()


def _params(endpoint: str, **config: Any) -> RendezvousParameters:
    return RendezvousParameters("ferrogrpc", endpoint, "job-1", 1, 3, **config)


def test_endpoints_parse_with_torchruns_default_port() -> None:
    assert parse_endpoint("node0:29500") == ("node0", 29500)
    assert parse_endpoint(" node0 ") == ("node0", 29400)
    assert parse_endpoint("[::1]:7") == ("::1", 7)
    assert parse_endpoint("[::1]") == ("::1", 29400)
    for bad in ("", "node0:x", "node0:70000", ":5"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


def test_the_entry_point_registers_the_backend_with_torch(tmp_path: Path) -> None:
    # As torchrun finds it: torch's registry loads the torchrun.handlers
    # entry points of the installed distributions when it is imported. (A
    # process outside the checkout: a stale *.egg-info in it would shadow
    # the installed metadata.)
    code = (
        "from torch.distributed.elastic.rendezvous import registry, RendezvousParameters\n"
        "h = registry.get_rendezvous_handler(RendezvousParameters("
        "'ferrogrpc', 'node0:1234', 'job', 1, 2))\n"
        "print(type(h).__module__, h.get_backend(), h.num_nodes_waiting())\n"
    )
    env = clean_env()
    env.pop("PYTHONPATH")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == ["ferrogrpc.control.torchrun", "ferrogrpc", "0"], out.stderr


def test_the_handler_exports_the_coordinator_and_the_bounds_to_the_workers() -> None:
    environ = {"FERROGRPC_ADVERTISE_HOST": "mine"}
    FerroGrpcRendezvousHandler(
        RendezvousParameters("ferrogrpc", "node0:29400", "job", 2, 4, local_addr="10.0.0.2"),
        environ=environ,
    )
    assert environ == {
        "FERROGRPC_COORDINATOR": "node0:29400",
        "FERROGRPC_ELASTIC": "1",
        "FERROGRPC_TORCHRUN_NNODES": "2:4",
        "FERROGRPC_ADVERTISE_HOST": "mine",  # the user's own is kept
        "FERROGRPC_BIND_HOST": "10.0.0.2",
    }
    # What a worker of a node of 3 reads from it: MIN nodes' processes.
    worker = {**environ, "LOCAL_WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "job"}
    s = Settings.from_env(worker)
    assert (s.min_world_size, s.coordinator, s.elastic) == (6, "node0:29400", True)
    assert s.torchrun_run_id == "job"
    assert Settings.from_env({**worker, "FERROGRPC_MIN_WORLD_SIZE": "1"}).min_world_size == 1
    assert Settings.from_env({"FERROGRPC_TORCHRUN_NNODES": "2"}).min_world_size == 1
    for bad in ("x", "3:2", "0:2"):
        with pytest.raises(fg.ConfigError, match="FERROGRPC_TORCHRUN_NNODES"):
            Settings.from_env({"FERROGRPC_TORCHRUN_NNODES": bad})


def test_each_node_rendezvous_alone_and_no_node_is_ever_waiting(served: Served) -> None:
    # [Note: two restart rules]: a node's rendezvous is its own (rank 0 of
    # one, with its own store) and never waits for another node; and no
    # agent is ever told that nodes wait (that would restart its workers).
    handlers = [FerroGrpcRendezvousHandler(_params(served.target), environ={}) for _ in range(2)]
    for h in handlers:
        info = h.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("k", "v")  # a store the agent can use for its own ranks
        assert info.bootstrap_store_info is not None
        assert info.bootstrap_store_info.master_port == served.port
        assert h.num_nodes_waiting() == 0 and not h.is_closed()
        assert (h.get_backend(), h.get_run_id(), h.use_agent_store) == ("ferrogrpc", "job-1", False)
    assert handlers[1].next_rendezvous().rank == 0  # a restart of that node's workers
    assert handlers[0].shutdown()


def test_a_restart_into_a_group_that_ended_closes_the_rendezvous(served: Served) -> None:
    m = served.coordinator.membership

    async def enter(peer: str, reason: int, epoch: int, lost: list[int]) -> Any:
        request = rpb.EnterRequest(
            peer_id=peer,
            address=f"{peer}:1",
            nonce="n" * 16,
            epoch=epoch,
            reason=reason,  # type: ignore[arg-type]
            lost=lost,
        )
        return await m.enter(request)

    async def first() -> None:
        await asyncio.gather(enter("a", rpb.ENTER_JOIN, 0, []), enter("b", rpb.ENTER_JOIN, 0, []))

    handler = FerroGrpcRendezvousHandler(_params(served.target), environ={})
    handler.next_rendezvous()  # the job starts: no group yet
    served.call(first())
    handler.next_rendezvous()  # a worker of this node died: its workers restart and join
    # b is lost: one of min_world_size 2 remains, the group is over.
    with pytest.raises(QuorumLostInRound):
        served.call(enter("a", rpb.ENTER_RECOVER, 1, [1]))
    with pytest.raises(RendezvousClosedError, match="quorum lost"):
        handler.next_rendezvous()
    assert handler.is_closed()
    # A node that starts now (its first rendezvous) starts a new group.
    fresh = FerroGrpcRendezvousHandler(_params(served.target), environ={})
    assert fresh.next_rendezvous().rank == 0
    fresh.set_closed()
    with pytest.raises(RendezvousClosedError):
        fresh.next_rendezvous()


def test_no_coordinator_times_out_naming_it_and_a_wrong_token_is_refused() -> None:
    port = free_port()
    handler = FerroGrpcRendezvousHandler(_params(f"127.0.0.1:{port}", join_timeout="1"), environ={})
    began = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=f"127.0.0.1:{port}.*ferrogrpc coordinator"):
        handler.next_rendezvous()
    assert time.monotonic() - began < 10
    s = Served(token="t" * 32)
    try:
        wrong = FerroGrpcRendezvousHandler(_params(s.target), environ={"FERROGRPC_TOKEN": "u" * 32})
        with pytest.raises(RendezvousConnectionError, match="UNAUTHENTICATED"):
            wrong.next_rendezvous()
    finally:
        s.close()


def test_elastic_under_another_torchrun_rendezvous_names_the_ferrogrpc_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FERROGRPC_COORDINATOR", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(fg.ConfigError, match="--rdzv-backend=ferrogrpc"):
        fg.init_backend(elastic=True)


def test_torchrun_passes_the_coordinator_to_its_workers(served: Served, tmp_path: Path) -> None:
    # The agent's environment reaches each worker, beside torchrun's own.
    # One write a line: both workers share torchrun's stdout, and print()
    # unbuffered writes the text and its newline apart, so two lines could
    # interleave into one (a fresh-clone CI run failed so).
    script = tmp_path / "env.py"
    script.write_text(
        "import json, os, sys\n"
        "sys.stdout.write(json.dumps({k: v for k, v in os.environ.items() if k.startswith("
        "('FERROGRPC_', 'LOCAL_', 'TORCHELASTIC_RUN'))}) + '\\n')\n"
        "sys.stdout.flush()\n"
    )
    env = clean_env()
    env.pop("PYTHONPATH")
    out = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:3"),
            *("--nproc-per-node=2", "--rdzv-backend=ferrogrpc", "--rdzv-id=job-7"),
            f"--rdzv-endpoint={served.target}",
            str(script),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(seen) == 2, out.stdout + out.stderr
    for worker in seen:
        s = Settings.from_env(worker)
        assert (s.coordinator, s.elastic, s.min_world_size) == (served.target, True, 2)
        assert s.torchrun_run_id == "job-7"


def test_the_torch_backends_elastic_refusal_names_the_torchrun_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under torchrun's ferrogrpc rendezvous FERROGRPC_ELASTIC is set, and
    # init_process_group("ferrogrpc") (fixed groups) says what to use.
    from types import SimpleNamespace

    from ferrogrpc.wrappers.process_group import create

    monkeypatch.setenv("FERROGRPC_ELASTIC", "1")
    opts = SimpleNamespace(store=None, group_rank=0, group_size=2)
    with pytest.raises(fg.ConfigError, match="does not support elastic groups") as caught:
        create(opts, None)
    assert "--rdzv-backend=ferrogrpc" in str(caught.value)
    assert "fg.init_backend(elastic=True)" in str(caught.value)
