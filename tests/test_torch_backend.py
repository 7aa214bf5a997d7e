"""ferrogrpc as a torch.distributed backend, with real processes: torch's
collectives against gloo, torch DDP (with and without communication hooks),
FSDP2 and DCP against single-process training, every way into
``init_process_group``, and a fixed selection of PyTorch's own distributed
test suite."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

import ferrogrpc as fg
from tests.helpers import free_port, rank_env, run_ranks, run_torchrun, spawn_rank

# PyTorch's own tests (torch.testing._internal.distributed.distributed_test)
# that exercise a backend's collectives on the CPU without naming gloo or
# nccl: each asserts exact results. They run in one process group (see
# tests/ranks/torch_suite.py).
PYTORCH_TESTS = [
    "test_get_rank",
    "test_get_rank_size_full_group",
    "test_barrier",
    "test_barrier_full_group",
    "test_broadcast",
    "test_broadcast_full_group",
    "test_reduce_sum",
    "test_reduce_product",
    "test_reduce_min",
    "test_reduce_max",
    "test_reduce_sum_twice",
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_product",
    "test_all_reduce_min",
    "test_all_reduce_max",
    "test_all_reduce_sum_complex",
    "test_all_reduce_full_group_sum",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_product",
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty",
    "test_scatter",
    "test_scatter_complex",
    "test_gather",
    "test_all_to_all",
    "test_all_to_all_complex",
    "test_all_to_all_single_equal_split",
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_send_recv_any_source",
    "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_isend",
    "test_irecv",
    "test_get_future",
]


def test_backend_is_registered_on_import() -> None:
    assert "ferrogrpc" in torch.distributed.Backend.backend_list
    assert torch.distributed.Backend("ferrogrpc") == "ferrogrpc"
    assert fg.ReduceOp.coerce(torch.distributed.ReduceOp.AVG) is fg.ReduceOp.MEAN


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "shm"), [(2, "1"), (3, "0")])
def test_torch_api_ddp_fsdp2_and_dcp_over_ferrogrpc(world: int, shm: str, tmp_path: Path) -> None:
    outputs = run_ranks(
        "torch_dist.py",
        world,
        timeout=220,
        env={"FERROGRPC_SHM": shm, "CHECKPOINT_DIR": str(tmp_path)},
    )
    for rank, out in enumerate(outputs):
        assert "DONE" in out, f"rank {rank}:\n{out}"
    assert "OK torch DDP" in outputs[0] and "OK FSDP2" in outputs[0] and "OK DCP" in outputs[0]


@pytest.mark.timeout(200)
def test_every_way_into_init_process_group(tmp_path: Path) -> None:
    for mode, extra in (
        ("tcp", []),
        ("file", [str(tmp_path / "f")]),
        ("store", []),
        ("devicemap", []),
    ):
        outputs = run_ranks("torch_init.py", 2, mode, *extra, timeout=60)
        expected = "grpc" if mode == "store" else "shared memory"  # pg_options shm=False
        for out in outputs:
            assert f"OK {mode} {expected}" in out, out


@pytest.mark.timeout(150)
def test_env_init_under_torchrun() -> None:
    proc = run_torchrun(2, str(Path(__file__).parent / "ranks" / "torch_init.py"), "env")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK env shared memory") == 2, proc.stdout


@pytest.mark.timeout(200)
def test_a_selection_of_pytorchs_own_distributed_tests(tmp_path: Path) -> None:
    outputs = run_ranks(
        "torch_suite.py", 2, *PYTORCH_TESTS, timeout=180, env={"TEMP_DIR": str(tmp_path)}
    )
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    results: dict[str, str] = json.loads(line[len("RESULT ") :])
    failed = {k: v for k, v in results.items() if not v.startswith("passed")}
    print(f"PyTorch's own tests over ferrogrpc: {len(results) - len(failed)} passed")
    assert not failed, failed
    assert len(results) == len(PYTORCH_TESTS) >= 15
    assert sys.modules.get("ferrogrpc") is not None


@pytest.mark.timeout(120)
def test_a_misused_op_is_refused_on_every_rank_at_once_and_nothing_misaligns() -> None:
    # Rank 0 misuses each list-form op (a wrong shape, a wrong list length):
    # it raises at once, every other rank fails the same op at once with a
    # ConfigError naming rank 0, and the next collective still pairs up.
    # gloo refuses each misuse too (tests/ranks/torch_misuse.py).
    outputs = run_ranks("torch_misuse.py", 3, timeout=100)
    cases = ["scatter", "all_gather", "all_gather_length", "gather", "reduce_scatter"]
    for rank, out in enumerate(outputs):
        for case in [*cases, "all_to_all", "work", "monitored_barrier"]:
            assert f"OK {case}" in out, (rank, case, out)
        assert "DONE" in out, (rank, out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["0"], ids=["grpc"])  # (the future path is the same on shm)
def test_a_peer_sigkilled_under_torch_ddp_makes_the_survivor_raise_not_crash(shm: str) -> None:
    # torch's reducer reads a comm hook's future in C++: a future failed
    # only in Python read as a result with no tensors, and the survivor died
    # with SIGSEGV. It must raise, naming the lost rank, as on gloo.
    port = free_port()
    procs = [
        spawn_rank("torch_ddp_kill.py", env=rank_env(rank, 2, port, FERROGRPC_SHM=shm))
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert procs[1].returncode == -signal.SIGKILL, (procs[1].returncode, outs[1])
    assert procs[0].returncode == 3, (procs[0].returncode, outs[0][-3000:])
    raised = [line for line in outs[0].splitlines() if line.startswith("RAISED")]
    assert raised and "rank 1" in raised[0], outs[0][-3000:]


@pytest.mark.timeout(120)
def test_destroy_then_init_again_three_times_in_one_process() -> None:
    # Fixed store keys made the second group read the first one's addresses,
    # and the other rank waited out the connect timeout (120 s).
    outputs = run_ranks("torch_regroup.py", 2, timeout=100, env={"STORE_PORT": str(free_port())})
    for rank, out in enumerate(outputs):
        for how in ("store", "env"):
            for i in range(3):
                assert f"OK {how} {i}" in out, (rank, how, i, out)
        assert "DONE" in out, (rank, out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "tcp-mesh"])
def test_on_a_broken_group_every_op_returns_a_work_whose_wait_raises(shm: bool) -> None:
    # Issue 56 item 26. Rank 1 closes; rank 0's next all_reduce fails naming
    # it, and its group is broken. Each op torch's API calls on the process
    # group then returns a Work whose wait() raises that failure, as gloo's
    # does; none raises at the call (a small all_reduce, which would run in
    # the caller's thread, least of all).
    import torch.distributed as dist

    from ferrogrpc.wrappers.process_group import FerroProcessGroup
    from tests.helpers import backends

    group = backends(2, shm=shm)
    try:
        pg = FerroProcessGroup(group[0], 0, 2)
        group[1].close()
        with pytest.raises(fg.PeerError):
            group[0].all_reduce(torch.ones(4))
        assert fg.testing.broken(group[0]) is not None
        t = torch.ones(4)
        ops = {
            "allreduce": lambda: pg.allreduce([t], dist.AllreduceOptions()),
            "allreduce (two tensors)": lambda: pg.allreduce([t, t.clone()]),
            "allreduce_coalesced": lambda: pg.allreduce_coalesced([t, t.clone()]),
            "broadcast": lambda: pg.broadcast([t], dist.BroadcastOptions()),
            "reduce": lambda: pg.reduce([t], dist.ReduceOptions()),
            "allgather": lambda: pg.allgather([[torch.empty(4), torch.empty(4)]], [t], None),
            "_allgather_base": lambda: pg._allgather_base(torch.empty(8), t),
            "reduce_scatter": lambda: pg.reduce_scatter(
                [torch.empty(4)], [[t, t.clone()]], dist.ReduceScatterOptions()
            ),
            "_reduce_scatter_base": lambda: pg._reduce_scatter_base(
                torch.empty(4), torch.ones(8), dist.ReduceScatterOptions()
            ),
            "alltoall_base": lambda: pg.alltoall_base(torch.empty(4), torch.ones(4), [], []),
            "barrier": lambda: pg.barrier(dist.BarrierOptions()),
            "send": lambda: pg.send([t], 1, 0),
            "recv": lambda: pg.recv([t], 1, 0),
            "recv_anysource": lambda: pg.recv_anysource([t], 0),
        }
        for name, call in ops.items():
            work = call()  # must not raise
            with pytest.raises(fg.PeerError) as info:
                work.wait()
            assert info.value.peer == 1, (name, info.value)
            assert "broken by an earlier failure" in str(info.value), (name, info.value)
            assert work.is_completed() and not work.is_success(), name
    finally:
        for b in group:
            b.close()
