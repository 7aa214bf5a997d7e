"""Failure semantics with real processes: a SIGKILLed or SIGSTOPped rank is
named on every surviving rank, quickly; afterwards the backend raises at once
with the original cause and closes cleanly. Plus: a failed DDP sync leaves
.grad untouched, and init/close cycles leak no threads or sockets."""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import ferrogrpc as fg
from tests.helpers import (
    backends,
    free_port,
    on_ranks,
    open_fds,
    os_thread_names,
    os_threads,
    rank_env,
    spawn_rank,
    wait_until,
)

WORLD = 4
VICTIM = 2

# The native threads of gRPC's process-wide runtime, by their kernel names:
# its event engine's worker pool and the pool's overseer, and its timer.
GRPC_RUNTIME_THREADS = ("event_engine", "lifeguard", "grpc_global_tim")


def _run_fault(
    mode: str, tmp_path: Path, extra_env: dict[str, str]
) -> tuple[list[dict[str, object]], float]:
    port = free_port()
    procs = [
        spawn_rank(
            "faults.py",
            mode,
            str(VICTIM),
            str(tmp_path),
            env=rank_env(rank, WORLD, port, **extra_env),
        )
        for rank in range(WORLD)
    ]
    try:
        outputs: dict[int, str] = {}
        for rank, proc in enumerate(procs):
            if rank == VICTIM:
                continue
            outputs[rank], _ = proc.communicate(timeout=60)
        results = []
        for rank, out in outputs.items():
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert lines, f"rank {rank} printed no result:\n{out}"
            results.append(json.loads(lines[0][len("RESULT ") :]))
        fault_time = float((tmp_path / "fault_time").read_text())
        return results, fault_time
    finally:
        victim = procs[VICTIM]
        if victim.poll() is None:
            victim.send_signal(signal.SIGCONT)
            victim.kill()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _victim_address(results: list[dict[str, object]]) -> str:
    addresses = {r["peer_address"] for r in results if r["peer_address"]}
    assert len(addresses) == 1, addresses
    return str(addresses.pop())


# The two data paths: every byte over gRPC, and same-host shared memory (the
# default on one machine). A SIGKILLed same-host rank is named within 1 s.
PATHS = {"grpc": ({"FERROGRPC_SHM": "0"}, 5.0), "shm": ({"FERROGRPC_SHM": "1"}, 1.0)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("path", "op"), [("grpc", "all_reduce"), ("shm", "all_reduce"), ("shm", "all_to_all")]
)
def test_sigkilled_peer_is_named_on_every_rank_within_5s(
    path: str, op: str, tmp_path: Path, report: Callable[[str], None]
) -> None:
    env, bound = PATHS[path]
    results, fault_time = _run_fault("kill", tmp_path, {**env, "FAULT_OP": op})
    for r in results:
        print(f"rank {r['rank']}: {r['type']} peer {r['peer']}: {r['message']}")
    address = _victim_address(results)
    for r in results:
        delay = float(r["time"]) - fault_time  # type: ignore[arg-type]
        report(
            f"SIGKILL of rank {VICTIM} ({path}, {op}): rank {r['rank']} raised {r['type']} "
            f"after {delay:.3f}s"
        )
        assert r["type"] == "PeerError", r
        assert r["peer"] == VICTIM, r
        assert f"rank {VICTIM}" in str(r["message"]) and address in str(r["message"]), r
        assert r["op"] == op and r["seq"] == 3, r
        assert delay < bound, f"rank {r['rank']} took {delay:.2f}s to notice"
        # Later collectives raise at once, with the original cause.
        assert r["later"] == "PeerError" and float(r["later_seconds"]) < 0.5, r  # type: ignore[arg-type]
        assert str(r["message"]).split("] ", 1)[1] in str(r["later_message"]), r
        assert int(r["threads_after_close"]) < int(r["threads_before_close"]), r  # type: ignore[call-overload]


@pytest.mark.timeout(90)
# The same-host path here; a SIGSTOPped rank over gRPC is named in
# test_direct.py (test_a_stopped_rank_is_named_as_stuck[grpc]).
@pytest.mark.parametrize("path", ["shm"])
@pytest.mark.parametrize("op", ["all_reduce", "all_to_all"])
def test_sigstopped_peer_times_out_naming_it(
    path: str, op: str, tmp_path: Path, report: Callable[[str], None]
) -> None:
    env = {"FAULT_IDLE": "2", "FAULT_OP": op, **PATHS[path][0]}
    results, fault_time = _run_fault("stop", tmp_path, env)
    for r in results:
        delay = float(r["time"]) - fault_time  # type: ignore[arg-type]
        report(
            f"SIGSTOP of rank {VICTIM} ({path}, {op}, idle timeout 2s): rank {r['rank']} raised "
            f"{r['type']} after {delay:.3f}s"
        )
        assert r["type"] == "CollectiveTimeoutError", r
        assert r["peer"] == VICTIM, r
        # idle without progress, then a ping unanswered for another idle
        assert 3.5 < delay < 10.0, delay
        assert r["later"] == "CollectiveTimeoutError", r


def _pair(idle: float = 5.0) -> tuple[fg.Backend, fg.Backend]:
    port = free_port()
    timeouts = fg.Timeouts(collective=max(30.0, 2 * idle), idle=idle, connect=30)
    with ThreadPoolExecutor(2) as pool:
        b0, b1 = pool.map(
            lambda r: fg.init_backend(r, 2, "127.0.0.1", port, timeouts=timeouts),
            [0, 1],  # type: ignore[arg-type]
        )
    return b0, b1


@pytest.mark.timeout(60)
def test_failed_ddp_sync_leaves_grad_untouched(report: Callable[[str], None]) -> None:
    # An idle timeout far longer than the test: a rank whose process is gone
    # is found by the liveness probe (its server refuses connections), not
    # by the idle timeout.
    b0, b1 = _pair(idle=60.0)
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    with ThreadPoolExecutor(2) as pool:
        ddps = list(
            pool.map(
                lambda a: fg.DDP(a[0], a[1], bucket_size_bytes=1024),
                zip(models, (b0, b1), strict=True),
            )
        )
    x = torch.randn(6, 8)
    # One good step on both ranks.
    with ThreadPoolExecutor(2) as pool:

        def step(i: int) -> None:
            ddps[i](x[i * 3 : (i + 1) * 3]).sum().backward()
            ddps[i].sync_gradients()

        list(pool.map(step, [0, 1]))
    # Rank 0 accumulates a second backward; rank 1 goes away.
    ddps[0](x[:3]).pow(2).sum().backward()
    before = {n: p.grad.clone() for n, p in models[0].named_parameters() if p.grad is not None}
    b1.close()
    start = time.monotonic()
    # Rank 1's server is gone: its stream refused, or never coming and rank 1
    # found unreachable by the probe, depending on timing.
    with pytest.raises(fg.PeerError) as info:
        ddps[0].sync_gradients()
    elapsed = time.monotonic() - start
    report(f"DDP sync with rank 1 gone (idle timeout 60s) failed after {elapsed:.3f}s")
    assert info.value.peer == 1
    assert elapsed < 15, elapsed
    for name, p in models[0].named_parameters():
        assert p.grad is not None and torch.equal(p.grad, before[name]), name
    with pytest.raises(type(info.value), match="broken by an earlier failure"):
        b0.all_reduce(torch.ones(3))
    b0.close()
    b0.close()  # idempotent


@pytest.mark.timeout(90)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_wrapper_sync_killed_mid_collective_leaves_grad_untouched(
    wrapper: str, path: str, report: Callable[[str], None]
) -> None:
    # No monkeypatch: rank 1 of 2 is SIGKILLed in the middle of the second
    # step's gradient sync, after some of its bytes have moved (DDP: in its
    # second bucket, the first done; FSDP: inside the reduce-scatters).
    # Every .grad of the survivor (DDP: the parameters'; FSDP: the
    # shards', from the first step) must be exactly what it was before the
    # call. On both data paths.
    port = free_port()
    procs = [
        spawn_rank("wrapper_faults.py", wrapper, env=rank_env(rank, 2, port, **PATHS[path][0]))
        for rank in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=75)
        procs[1].wait(timeout=10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert procs[1].returncode == -signal.SIGKILL, (procs[1].returncode, procs[1].stdout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rank 0 printed no result:\n{out}"
    r = json.loads(lines[0][len("RESULT ") :])
    report(
        f"{wrapper} sync ({path}), rank 1 SIGKILLed after {r.get('moved', 0) / 2**20:.1f} MiB had "
        f"reached rank 0: {r['type']}, {len(r.get('differ', []))} of {r.get('grads')} .grad changed"
    )
    assert r["type"] == "PeerError" and r["peer"] == 1, r
    assert r["moved"] > 0, f"no bytes had moved when the sync failed: {r}"
    assert r["differ"] == [], f"a failed {wrapper} sync changed .grad of {r['differ']}"


@pytest.mark.timeout(60)
def test_ddp_backward_on_a_broken_backend_leaves_the_error_to_sync() -> None:
    # A peer fails while backward runs: the buckets that backward's hooks
    # start next find the backend broken. Backward must still complete
    # (an error raised in an autograd hook would stop it halfway through
    # accumulating .grad); sync_gradients() raises, and every .grad holds
    # this rank's own gradients. Made deterministic: the backend is broken
    # before backward starts.
    b0, b1 = _pair(idle=60.0)
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    with ThreadPoolExecutor(2) as pool:
        ddps = list(
            pool.map(
                lambda a: fg.DDP(a[0], a[1], bucket_size_bytes=1024),
                zip(models, (b0, b1), strict=True),
            )
        )
    assert len(ddps[0].bucket_layout()) > 1
    b1.close()
    with pytest.raises(fg.PeerError):
        b0.all_reduce(torch.ones(1 << 20))  # rank 1 is gone: rank 0 is broken
    x = torch.randn(3, 8)
    reference = copy.deepcopy(models[0])
    reference(x).sum().backward()
    ddps[0](x).sum().backward()  # every bucket's launch meets the broken backend
    with pytest.raises(fg.PeerError, match="broken by an earlier failure"):
        ddps[0].sync_gradients()
    for (name, p), q in zip(models[0].named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(p.grad, q.grad), name
    b0.close()


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if use_b else out


class _FailedWork:
    def wait(self, timeout: float | None = None) -> None:
        raise fg.PeerError("injected failure", rank=0, world_size=1, op="all_reduce")


def _fails_midway(tensor: torch.Tensor, *args: object, **kwargs: object) -> _FailedWork:
    tensor.fill_(float("nan"))  # a failed collective leaves its tensor unspecified
    return _FailedWork()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restore_old_view", [False, True])
def test_ddp_failure_after_partial_writes_leaves_grad_view_untouched(
    restore_old_view: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a sync every .grad is a view of a bucket buffer, and buffers
    # alternate: an all-reduce that fails after writing part of its tensor
    # must leave every .grad as it was. Also when the user puts back a .grad
    # kept from two syncs ago, which is a view of the buffer being refilled.
    backend = fg.init_backend(0, 1, "127.0.0.1", free_port())
    torch.manual_seed(0)
    model = _TwoHeads()
    ddp = fg.DDP(model, backend)
    x = torch.randn(2, 4)
    ddp(x, True).sum().backward()
    ddp.sync_gradients()  # views of buffer 0
    kept = model.b.weight.grad
    ddp(x, True).sum().backward()
    ddp.sync_gradients()  # views of buffer 1
    if restore_old_view:
        model.b.weight.grad = kept  # a view of buffer 0, which the next step fills
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # The next backward accumulates one more step's gradient into head a.
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(x, False).sum().backward()
    for name, p in reference.named_parameters():
        if name.startswith("a."):
            assert p.grad is not None
            expected[name] = expected[name] + p.grad
    monkeypatch.setattr(backend, "all_reduce", _fails_midway)
    ddp(x, False).sum().backward()  # fills buffer 0; its all-reduce starts and fails
    with pytest.raises(fg.PeerError, match="injected"):
        ddp.sync_gradients()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, expected[name]), name
    backend.close()


@pytest.mark.timeout(90)
def test_init_close_cycles_leak_no_threads_or_fds(report: Callable[[str], None]) -> None:
    # Threads as the kernel counts them (gRPC's and the TCPStore's are not
    # Python threads) and every file descriptor (sockets, memfds, pipes),
    # after cycles of a clean run and of a failure (rank 1 closes while rank
    # 0's all_reduce runs) followed by close(), with the same-host plane and
    # without: back to where they started, exactly. gRPC's own runtime,
    # which ferrogrpc holds for the whole process (grpc_auth.keep_aio_runtime),
    # sizes its worker pool by load: its threads are counted apart, and may
    # not grow by more than a thread or two, whatever the number of cycles.
    def cycle(fail: bool, shm: bool) -> None:
        timeouts = fg.Timeouts(collective=30, idle=5, connect=30)
        b0, b1 = group = backends(2, timeouts=timeouts, shm=shm)
        ts = [torch.ones(1000), torch.ones(1000)]
        on_ranks(lambda r: group[r].all_reduce(ts[r]), 2)
        assert ts[0][0].item() == 2.0
        if fail:
            work = b0.all_reduce(torch.ones(1 << 20), async_op=True)
            b1.close()
            with pytest.raises(fg.PeerError):
                work.wait()
        b0.close()
        b1.close()

    def runtime() -> int:
        names = os_thread_names()
        return sum(names.get(name, 0) for name in GRPC_RUNTIME_THREADS)

    def counts() -> tuple[int, int]:
        return os_threads() - runtime(), open_fds()

    # gRPC starts its process-wide threads once, torch its own pools.
    for shm in (False, True):
        cycle(False, shm)
        cycle(True, shm)
    # What earlier tests left for the garbage collector is not this test's.
    gc.collect()

    # Only the main thread and gRPC's process-wide poller stay.
    def others() -> list[str]:
        return [
            t.name
            for t in threading.enumerate()
            if t is not threading.main_thread() and "_poll" not in t.name
        ]

    try:
        wait_until(lambda: not others(), 10, "warm-up threads to end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running: {others()}") from None
    threads, fds = counts()
    names, pool = os_thread_names(), runtime()
    for shm in (False, True):
        cycle(False, shm)
        cycle(True, shm)

    # A failure's exception and its traceback hold gRPC call objects in
    # reference cycles (frames that hold the exception), which only the
    # garbage collector frees; until then gRPC's poller thread and its
    # socket pair stay. Python collects them on its own schedule; here the
    # collection is made to happen, and what was left before it reported.
    def released() -> bool:
        return counts()[0] <= threads and counts()[1] <= fds

    deadline = time.monotonic() + 2
    while not released() and time.monotonic() < deadline:
        time.sleep(0.01)
    before_gc = counts()
    gc.collect()
    try:
        wait_until(released, 10, "release")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; threads by name {names} -> {os_thread_names()}") from None
    finally:
        report(
            f"4 init/close cycles (2 with a failure): OS threads {threads} -> {before_gc[0]} "
            f"before a garbage collection, {counts()[0]} after (gRPC's runtime apart: "
            f"{pool} -> {runtime()}); fds {fds} -> {before_gc[1]}, {counts()[1]}"
        )
    assert runtime() <= pool + 2, (names, os_thread_names())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", [1000, 1 << 20])
@pytest.mark.parametrize("transport", ["grpc", "memory"])
async def test_gone_neighbour_is_named_long_before_the_idle_timeout(
    transport: str, numel: int, report: Callable[[str], None]
) -> None:
    # Rank 1 has closed (its process exited, say), and nobody tells rank 2.
    # A large all_reduce is a ring: rank 2 waits for rank 1's stream, which
    # will never come, while its own stream to rank 0 is accepted; the
    # liveness probe finds rank 1's server refusing connections and names
    # it, well inside the 60 s idle timeout. A small one is one exchange:
    # rank 2's message to rank 1 is refused at once.

    timeouts = fg.Timeouts(collective=120, idle=60, connect=20)
    async with fg.testing.local_group(3, transport=transport, timeouts=timeouts) as peers:  # type: ignore[arg-type]
        await peers[1].close()
        start = time.monotonic()
        with pytest.raises(fg.PeerError) as info:
            await peers[2].all_reduce(torch.ones(numel))
        elapsed = time.monotonic() - start
    report(
        f"gone neighbour ({transport}, {numel * 4} B, idle timeout 60s) named after {elapsed:.2f}s"
    )
    assert info.value.peer == 1, info.value
    assert "rank 1" in str(info.value), info.value
    if numel > 1000:
        assert "gone" in str(info.value), info.value
    assert elapsed < 10, elapsed


@pytest.mark.timeout(60)
async def test_a_rank_gone_after_taking_its_message_is_named_while_another_is_late(
    report: Callable[[str], None],
) -> None:
    # A small collective over gRPC links (the TCP mesh off): rank 2 sends to
    # ranks 0 and 1, then takes their messages in turn. Rank 1 takes rank
    # 2's message and then closes (its process exits, say); rank 0 is alive
    # and never calls. While rank 2 waits for rank 0, the probes must cover
    # rank 1 too and name it, long before the 60 s idle timeout. (The race
    # issue 33 names: rank 2's send sometimes beat the news of rank 1's
    # close, and then only rank 0, which answers, was probed.)
    timeouts = fg.Timeouts(collective=120, idle=60, connect=20)
    async with fg.testing.local_group(3, timeouts=timeouts, direct=False) as peers:
        call = asyncio.ensure_future(peers[2].all_reduce(torch.ones(1000)))
        await asyncio.sleep(0)
        key = (peers[1]._ctx.group, fg.testing.last_seq(peers[2]), 0, 2)
        # Where rank 1's intake delivers it (the mailbox made here if first).
        box = peers[1]._ctx.mailboxes.get(key)
        async with asyncio.timeout(5):  # "rank 2's message never reached rank 1"
            await asyncio.shield(box.arrived)
        await peers[1].close()
        start = time.monotonic()
        with pytest.raises(fg.PeerError) as info:
            async with asyncio.timeout(15):
                await call
        elapsed = time.monotonic() - start
    report(f"rank gone after taking its message, another late: named after {elapsed:.2f}s")
    assert info.value.peer == 1, info.value
    assert "rank 1" in str(info.value), info.value
    assert elapsed < 10, elapsed


@pytest.mark.timeout(60)
def test_grpc_runtime_outlives_every_closed_backend_so_no_collection_shuts_it_down() -> None:
    # grpc.aio shuts its runtime down when its last channel or server is
    # freed, waiting for every queued operation to finish, in whatever thread
    # collects the garbage (a hang, once, in a test process's last
    # gc.collect()). ferrogrpc holds the runtime for the whole process: after
    # every backend closed and every object collected, grpc's poller thread
    # is still there. In a fresh process, where nothing else holds it.
    code = (
        "import gc, threading, time, torch\n"
        "from tests.helpers import backends, on_ranks\n"
        "group = backends(2)\n"
        "ts = [torch.ones(3), torch.ones(3)]\n"
        "on_ranks(lambda r: group[r].all_reduce(ts[r]), 2)\n"
        "assert ts[0].tolist() == [2.0] * 3\n"
        "for b in group:\n"
        "    b.close()\n"
        "del group\n"
        "for _ in range(3):\n"
        "    gc.collect()\n"
        "time.sleep(0.5)\n"
        "print('POLLERS', sum('_poll' in t.name for t in threading.enumerate()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    ).stdout
    assert "POLLERS 1" in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "sender"), [(2, 1), (3, 1)])
async def test_a_ring_stream_ended_cleanly_without_its_end_markers_is_refused(
    world: int, sender: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 56 item 21. ``sender`` writes every chunk of a ring all-reduce
    # and then ends its stream cleanly, dropping its end markers (a hook on
    # its writes, not a race): its right neighbour must fail, naming it, and
    # so must every other rank but the sender. (The sender itself may
    # finish: its left's markers say every other rank has all the data,
    # which is true. A sender whose stream really ends early has failed.)
    # In a world of 2, if the receiver took a bare end for success, both
    # ranks would finish.
    from ferrogrpc.algorithms import ring
    from ferrogrpc.transport import wire

    write = ring.LaneRunner._write
    dropped: list[int] = []

    async def drop_markers(
        self: ring.LaneRunner, stream: ring.OutStream, message: bytes, step: int
    ) -> None:
        if self.ctx.identity.rank == sender and wire.decode(message)[0].end:
            dropped.append(self.job.seq)
            return
        await write(self, stream, message, step)

    monkeypatch.setattr(ring.LaneRunner, "_write", drop_markers)
    timeouts = fg.Timeouts(collective=30, idle=10, connect=20)
    chunks = fg.ChunkPolicy(chunk_bytes=128 << 10, max_lanes=1)
    async with fg.testing.local_group(
        world, timeouts=timeouts, chunk_policy=chunks, direct=False
    ) as peers:
        tensors = [torch.full((world * 65536,), float(r + 1)) for r in range(world)]
        async with asyncio.timeout(20):
            results = await asyncio.gather(
                *(p.all_reduce(t) for p, t in zip(peers, tensors, strict=True)),
                return_exceptions=True,
            )
    assert dropped, "the ring never wrote an end marker: not a ring collective?"
    receiver = (sender + 1) % world
    error = results[receiver]
    assert isinstance(error, fg.PeerError), results
    assert error.peer == sender, error
    assert f"rank {sender} (" in str(error) and "without its end markers" in str(error), error
    for r, res in enumerate(results):
        if r != sender:
            assert isinstance(res, fg.FerroGrpcError), (r, res)
            assert res.peer == sender, (r, res)
