"""The coordinator in-process: rank assignment, frozen round answers with the
session nonces, freed slots, elastic sizing; and a taken port is a clean error.
Issue 17: the token and mutual TLS, one live call per slot, limits on what a
joiner sends, rate-limited logging that never blocks serving."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ferrogrpc as fg
from ferrogrpc.control.coordinator import Coordinator, CoordinatorRendezvous, Limits, fetch_status
from ferrogrpc.control.coordinator_client import SERVICE
from ferrogrpc.env import Settings
from ferrogrpc.transport.auth import aio_channel, token_metadata
from ferrogrpc.transport.grpc_streams import GrpcTransport
from ferrogrpc.v1 import rendezvous_pb2 as rpb
from tests.helpers import free_port, reference_sum
from tests.test_security import _certificates

pytestmark = pytest.mark.timeout(60)


async def test_rounds_answer_ranks_tables_and_nonces() -> None:
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    try:
        target = f"127.0.0.1:{port}"
        a, b = CoordinatorRendezvous(target, timeout=10), CoordinatorRendezvous(target, timeout=10)
        ra, rb = await asyncio.gather(
            a.exchange(None, None, "host-a:1", "nonce-a"),
            b.exchange(None, 2, "host-b:2", "nonce-b"),
        )
        assert {ra.rank, rb.rank} == {0, 1} and ra.world_size == rb.world_size == 2
        assert ra.addresses == rb.addresses and ra.nonces == rb.nonces
        assert ra.nonces[ra.rank] == "nonce-a" and ra.nonces[rb.rank] == "nonce-b"
        # A new peer after completion starts a new round; the old answers stay.
        c = CoordinatorRendezvous(target, timeout=1)
        with pytest.raises(fg.RendezvousError):
            await c.exchange(None, None, "host-c:3", "nonce-c")
        await asyncio.gather(a.close(), b.close(), c.close())
    finally:
        await coordinator.stop(0)


async def _wait_joined(target: str, joined: int) -> None:
    """Poll the coordinator's status until ``joined`` peers are in its round."""
    deadline = time.monotonic() + 20
    while (await fetch_status(target)).joined != joined:
        assert time.monotonic() < deadline, f"the coordinator never had {joined} joined"
        await asyncio.sleep(0.01)


async def test_a_joiner_that_gives_up_frees_its_slot() -> None:
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    try:
        target = f"127.0.0.1:{port}"
        quitter = CoordinatorRendezvous(target, timeout=1)
        with pytest.raises(fg.RendezvousError):
            await quitter.exchange(None, None, "dead:1", "n0")
        # Its slot is freed once the coordinator sees it gone.
        await _wait_joined(target, 0)
        a, b = CoordinatorRendezvous(target, timeout=10), CoordinatorRendezvous(target, timeout=10)
        ra, _ = await asyncio.gather(
            a.exchange(None, None, "live-a:1", "na"), b.exchange(None, None, "live-b:2", "nb")
        )
        assert "dead:1" not in ra.addresses, ra.addresses
        await asyncio.gather(a.close(), b.close(), quitter.close())
    finally:
        await coordinator.stop(0)


async def test_a_round_without_a_world_size_is_sized_by_who_joined() -> None:
    coordinator = Coordinator(0, min_ranks=2, join_window=0.5)
    port = await coordinator.start("127.0.0.1:0")
    try:
        target = f"127.0.0.1:{port}"
        joiners = [CoordinatorRendezvous(target, timeout=10) for _ in range(3)]
        results = await asyncio.gather(
            *(j.exchange(None, None, f"h{i}:1", f"n{i}") for i, j in enumerate(joiners))
        )
        assert sorted(r.rank for r in results) == [0, 1, 2]
        assert all(r.world_size == 3 for r in results)
        await asyncio.gather(*(j.close() for j in joiners))
    finally:
        await coordinator.stop(0)


async def test_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        transport = GrpcTransport(f"127.0.0.1:{port}")
        with pytest.raises(fg.ConfigError, match=f"127.0.0.1:{port}"):
            await transport.start(None)  # type: ignore[arg-type]


async def _hold_aio_runtime(keep: Callable[[], None]) -> None:
    keep()


def test_a_group_that_never_forms_is_a_rendezvous_error() -> None:
    import threading

    from ferrogrpc.transport.auth import keep_aio_runtime
    from tests.helpers import wait_until

    # grpc.aio's process-wide poller thread is held for the process's life
    # (keep_aio_runtime): started first, it is not counted as this call's.
    asyncio.run(_hold_aio_runtime(keep_aio_runtime))
    before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(fg.RendezvousError, match="within"):
        fg.init_backend(
            0, 2, "127.0.0.1", free_port(), timeouts=fg.Timeouts(collective=5, idle=5, connect=2)
        )
    assert time.monotonic() - start < 15
    # Its threads end, the rendezvous's executor thread included.
    wait_until(lambda: threading.active_count() <= before, 10, "threads to end")


async def test_a_late_neighbour_that_answers_pings_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    # Rank 2 starts only once it has been pinged twice, each time after a
    # whole idle timeout without progress, and answered: the idle ping ran
    # and found a late rank, not a stuck one. (Counted, so that no time
    # window decides it.)
    pings = 0
    ping = GrpcTransport.ping

    async def counted(self: GrpcTransport, dst: int, timeout: float) -> None:
        nonlocal pings
        await ping(self, dst, timeout)
        pings += dst == 2

    monkeypatch.setattr(GrpcTransport, "ping", counted)
    timeouts = fg.Timeouts(collective=30, idle=1.0, connect=10)
    async with fg.testing.local_group(3, timeouts=timeouts) as peers:
        ts = [torch.ones(1000) * (r + 1) for r in range(3)]

        async def late(p: fg.Peer, t: torch.Tensor) -> torch.Tensor:
            deadline = time.monotonic() + 20
            while pings < 2:  # rank-local work, for two idle timeouts at least
                assert time.monotonic() < deadline, "nobody pinged the late rank"
                await asyncio.sleep(0.01)
            return await p.all_reduce(t)

        await asyncio.gather(
            peers[0].all_reduce(ts[0]), peers[1].all_reduce(ts[1]), late(peers[2], ts[2])
        )
        assert all(bool(t.eq(6.0).all()) for t in ts)


# ------------------------------------------------ issue 17: the coordinator

TOKEN = "coordinator-test-token"
PEER_ID = "a" * 32


def _raw(b: bytes) -> bytes:
    return b


async def _call(
    target: str,
    method: str,
    request: bytes,
    token: str | None = None,
    timeout: float = 10,
    tls: fg.TLSConfig | None = None,
) -> tuple[grpc.StatusCode, bytes | None]:
    """One raw call to the coordinator: its status code and answer."""
    async with aio_channel(target, tls) as channel:
        stub = channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_raw, response_deserializer=_raw
        )
        try:
            answer = await stub(request, timeout=timeout, metadata=token_metadata(token))
        except grpc.aio.AioRpcError as exc:
            return exc.code(), None
        return grpc.StatusCode.OK, answer


def _join(address: str, peer_id: str = PEER_ID, **fields: object) -> bytes:
    fields.setdefault("nonce", "n")
    request = rpb.JoinRequest(address=address, requested_rank=-1, peer_id=peer_id, **fields)  # type: ignore[arg-type]
    return request.SerializeToString()


async def _health(target: str, token: str | None) -> grpc.StatusCode:
    async with aio_channel(target, None) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5, metadata=token_metadata(token)
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


@pytest.mark.parametrize("tls", [False, True], ids=["token", "token+tls"])
async def test_the_coordinator_requires_the_token_and_ranks_with_it_train(
    tls: bool, tmp_path: object
) -> None:
    good = _certificates(str(tmp_path))[0] if tls else None
    coordinator = Coordinator(2, token=TOKEN, tls=good)
    port = await coordinator.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    try:
        # Without the token (or with a wrong one), every call is refused.
        for token in (None, "wrong"):
            for method, request in (
                ("Join", _join("evil:1")),
                ("Status", rpb.StatusRequest().SerializeToString()),
                ("Heartbeat", rpb.HeartbeatRequest(rank=0).SerializeToString()),
            ):
                code, _ = await _call(target, method, request, token, tls=good)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method, token, code)
            if not tls:
                assert await _health(target, token) == grpc.StatusCode.UNAUTHENTICATED
        assert coordinator.joined == 0
        with pytest.raises(fg.RendezvousError, match="UNAUTHENTICATED"):
            await fetch_status(target, tls=good)
        if tls:  # and without TLS, no connection at all
            code, _ = await _call(target, "Status", b"", TOKEN)
            assert code == grpc.StatusCode.UNAVAILABLE, code
        else:
            assert await _health(target, TOKEN) == grpc.StatusCode.OK
        # Ranks with the token: rendezvous, then an all_reduce.
        settings = Settings(token=TOKEN, tls=good, timeouts=fg.Timeouts(20, 10, 20))
        peers = await asyncio.gather(
            *(
                fg.Peer.start(
                    None,
                    None,
                    rendezvous=CoordinatorRendezvous(target, timeout=20, token=TOKEN, tls=good),
                    settings=settings,
                )
                for _ in range(2)
            )
        )
        try:
            assert sorted(p.rank for p in peers) == [0, 1]
            inputs = [torch.randn(300_000, dtype=torch.float64) for _ in peers]
            ref = reference_sum(inputs)
            outs = [t.clone() for t in inputs]
            await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, outs, strict=True)))
            for t in outs:
                torch.testing.assert_close(t, ref, atol=1e-10, rtol=1e-10)
            status = await fetch_status(target, token=TOKEN, tls=good)
            assert status.joined == 2 and status.world_size == 2
            # The ranks' own servers refuse a client without the token too.
            for p in peers:
                code, _ = await _call(p.address, "Status", b"", tls=good)
                assert code == grpc.StatusCode.UNAUTHENTICATED, code
        finally:
            await asyncio.gather(*(p.close() for p in peers))
    finally:
        await coordinator.stop(0)


async def test_concurrent_joins_with_one_identity_never_share_a_rank() -> None:
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    try:
        # Ids are random, long, and never the protobuf default.
        for peer_id in ("", "short"):
            code, _ = await _call(target, "Join", _join("x:1", peer_id))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (peer_id, code)
        # Eight concurrent Joins with one id, then another joiner.
        same = [asyncio.ensure_future(_call(target, "Join", _join(f"same:{i}"))) for i in range(8)]
        deadline = time.monotonic() + 10
        while coordinator.joined < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        other = await _call(target, "Join", _join("other:1", "b" * 32))
        results = await asyncio.gather(*same)
        assert other[0] == grpc.StatusCode.OK
        granted = [rpb.JoinResponse.FromString(a) for code, a in results if a is not None]
        refused = [code for code, a in results if a is None]
        assert len(granted) == 1, results  # the slot's one live call
        assert set(refused) == {grpc.StatusCode.ABORTED}, refused
        assert other[1] is not None
        ranks = [granted[0].rank, rpb.JoinResponse.FromString(other[1]).rank]
        assert sorted(ranks) == [0, 1], ranks
    finally:
        await coordinator.stop(0)


async def test_a_retry_that_takes_a_slot_over_keeps_it_when_the_first_call_ends() -> None:
    # The race of issue 17: A joins; A's retry attaches to A's slot; A's
    # first call ends (cancelled); a new joiner must not get A's rank.
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    try:
        first = asyncio.ensure_future(_call(target, "Join", _join("a:1")))
        deadline = time.monotonic() + 10
        while coordinator.joined < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        retry = asyncio.ensure_future(_call(target, "Join", _join("a:1")))
        code, _ = await asyncio.wait_for(first, 10)  # ends: taken over
        assert code == grpc.StatusCode.ABORTED, code
        assert coordinator.joined == 1  # the slot stayed, with the retry
        newcomer = await _call(target, "Join", _join("b:1", "b" * 32))
        a = await asyncio.wait_for(retry, 10)
        assert a[1] is not None and newcomer[1] is not None, (a, newcomer)
        ranks = {
            rpb.JoinResponse.FromString(a[1]).rank,
            rpb.JoinResponse.FromString(newcomer[1]).rank,
        }
        assert ranks == {0, 1}, ranks
        # The built-in client's retry loop draws its id once per rendezvous.
        assert CoordinatorRendezvous(target).peer_id != CoordinatorRendezvous(target).peer_id
    finally:
        await coordinator.stop(0)


async def test_oversized_joins_are_refused_at_once_and_the_round_completes(
    report: Callable[[str], None],
) -> None:
    coordinator = Coordinator(2)
    port = await coordinator.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    try:
        timings = {}
        for what, request, expected in (
            ("64 KiB address", _join("x" * (64 << 10)), grpc.StatusCode.RESOURCE_EXHAUSTED),
            ("3.9 MiB address", _join("x" * (3900 << 10)), grpc.StatusCode.RESOURCE_EXHAUSTED),
            ("1 KiB address", _join("x" * 1024), grpc.StatusCode.INVALID_ARGUMENT),
            ("1 KiB host key", _join("h:1", host="h" * 1024), grpc.StatusCode.INVALID_ARGUMENT),
            ("1 KiB nonce", _join("h:1", nonce="n" * 1024), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            start = time.monotonic()
            code, _ = await _call(target, "Join", request, timeout=30)
            timings[what] = time.monotonic() - start
            assert code == expected, (what, code)
            assert timings[what] < 5.0, (what, timings[what])
        assert coordinator.joined == 0
        # Real ranks still complete the round.
        a, b = CoordinatorRendezvous(target, timeout=10), CoordinatorRendezvous(target, timeout=10)
        ra, rb = await asyncio.gather(
            a.exchange(None, None, "a:1", "na"), b.exchange(None, None, "b:1", "nb")
        )
        assert {ra.rank, rb.rank} == {0, 1} and ra.addresses == rb.addresses
        await asyncio.gather(a.close(), b.close())
        report(
            "oversized Joins refused in "
            + ", ".join(f"{k}: {v * 1000:.0f} ms" for k, v in timings.items())
        )
    finally:
        await coordinator.stop(0)


async def test_the_elastic_cap_refuses_at_once() -> None:
    coordinator = Coordinator(0, min_ranks=100, join_window=30, limits=Limits(max_ranks=3))
    target = f"127.0.0.1:{await coordinator.start('127.0.0.1:0')}"
    try:
        held = [
            asyncio.ensure_future(_call(target, "Join", _join(f"h{i}:1", f"{i}" * 32)))
            for i in range(3)
        ]
        deadline = time.monotonic() + 10
        while coordinator.joined < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        start = time.monotonic()
        code, _ = await _call(target, "Join", _join("late:1", "z" * 32))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
        assert time.monotonic() - start < 5
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    finally:
        await coordinator.stop(0)


async def test_malformed_requests_are_one_rate_limited_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    coordinator = Coordinator(2)
    coordinator._bad_requests.interval = 0.2  # test: a short window
    port = await coordinator.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    try:
        with caplog.at_level(logging.WARNING, logger="ferrogrpc.coordinator"):
            deadline = time.monotonic() + 10
            sent = 0
            while not any("more since" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline
                for method in ("Join", "Heartbeat", "Status"):
                    code, _ = await _call(target, method, b"\xff\xff\xff garbage")
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code)
                    sent += 1
            # Still serving, and nothing joined.
            status = await fetch_status(target)
            assert status.joined == 0
        lines = [r for r in caplog.records if r.name == "ferrogrpc.coordinator"]
        assert 1 <= len(lines) < sent, (len(lines), sent)
        for record in lines:
            assert record.exc_info is None and "\n" not in record.getMessage(), record
            assert "undecodable" in record.getMessage()
    finally:
        await coordinator.stop(0)


@pytest.mark.timeout(120)
def test_the_coordinator_process_with_a_token_and_a_stuck_stderr() -> None:
    # `python -m server` with FERROGRPC_TOKEN: the healthcheck and `ferrogrpc
    # status` pass when given the token and fail without it; and with its
    # stderr never read (a full pipe), it keeps answering while it logs.
    import fcntl
    import subprocess
    import sys

    from tests.helpers import ROOT, clean_env

    port = free_port()
    target = f"127.0.0.1:{port}"
    env = dict(clean_env(), FERROGRPC_TOKEN=TOKEN)
    without = clean_env()
    coord = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--world-size",
            "0",
            "--min-ranks",
            "1000",
            "--join-window",
            "60",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # never read
        text=True,
    )
    try:
        assert coord.stderr is not None and coord.stdout is not None
        fcntl.fcntl(coord.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)
        assert "token required" in coord.stdout.readline()
        # It listens where --host says, and only there.
        ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        mine = [line.split()[3] for line in ss.splitlines() if f"pid={coord.pid}," in line]
        assert [m.replace("[::ffff:127.0.0.1]", "127.0.0.1") for m in mine] == [target], mine

        def run(*cmd: str, with_token: bool) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, *cmd],
                env=env if with_token else without,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=30,
            )

        deadline = time.monotonic() + 30
        while run("-m", "server.health", target, with_token=True).returncode:
            assert time.monotonic() < deadline, "never healthy"
        # The three checks are independent: run them at once.
        with ThreadPoolExecutor(3) as pool:
            health, status, allowed = pool.map(
                lambda c: run(*c[0], with_token=c[1]),
                [
                    (("-m", "server.health", target), False),
                    (("-m", "ferrogrpc.cli", "status", target), False),
                    (("-m", "ferrogrpc.cli", "status", target), True),
                ],
            )
        assert health.returncode == 1 and "UNAUTHENTICATED" in health.stderr, health
        assert status.returncode == 1 and "UNAUTHENTICATED" in status.stderr, status
        assert "0/0 joined" in allowed.stdout, allowed

        async def flood() -> float:
            # 200 joiners (a log line each, far more than the 4 KiB pipe holds),
            # then a Status call: answered at once all the same.
            calls = [
                asyncio.ensure_future(
                    _call(target, "Join", _join(f"host-{i}:1", f"{i:032d}"), TOKEN, timeout=60)
                )
                for i in range(200)
            ]
            deadline = time.monotonic() + 30
            while True:
                status = await fetch_status(target, token=TOKEN)
                if status.joined == 200:
                    break
                assert time.monotonic() < deadline, status.joined
            start = time.monotonic()
            for _ in range(5):
                await fetch_status(target, token=TOKEN)
            took = time.monotonic() - start
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            return took

        took = asyncio.run(flood())
        assert took < 2.0, took
    finally:
        coord.terminate()
        try:
            coord.wait(timeout=10)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait()


async def test_a_late_join_wipes_the_table_but_not_the_running_job() -> None:
    # What a coordinator without a token lets anyone do (SECURITY.md):
    # a Join after the round completed starts a new round; the ranks of the
    # running job keep working, with correct results.
    coordinator = Coordinator(2)
    target = f"127.0.0.1:{await coordinator.start('127.0.0.1:0')}"
    settings = Settings(timeouts=fg.Timeouts(20, 10, 20))
    try:
        peers = await asyncio.gather(
            *(
                fg.Peer.start(
                    None,
                    None,
                    rendezvous=CoordinatorRendezvous(target, timeout=20),
                    settings=settings,
                )
                for _ in range(2)
            )
        )
        try:
            late = asyncio.ensure_future(_call(target, "Join", _join("late:1", "l" * 32)))
            deadline = time.monotonic() + 10
            while (status := await fetch_status(target)).joined != 1:
                assert time.monotonic() < deadline, status
            assert [m.address for m in status.members] == ["late:1"]
            inputs = [torch.randn(50_000, dtype=torch.float64) for _ in peers]
            ref = reference_sum(inputs)
            outs = [t.clone() for t in inputs]
            await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, outs, strict=True)))
            for t in outs:
                torch.testing.assert_close(t, ref, atol=1e-10, rtol=1e-10)
            late.cancel()
            await asyncio.gather(late, return_exceptions=True)
        finally:
            await asyncio.gather(*(p.close() for p in peers))
    finally:
        await coordinator.stop(0)


def _imported(*args: str) -> list[str]:
    """The modules ``python -X importtime ARGS`` imported."""
    import subprocess
    import sys

    from tests.helpers import ROOT, clean_env

    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=60,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert lines, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert "Traceback" not in proc.stderr, "\n".join(errors[-10:])
    return [line.rsplit("|", 1)[-1].strip() for line in lines]


def _torch(imported: list[str]) -> bool:
    """Whether any torch module is among ``imported`` (a module imported by
    importlib.import_module is not listed itself: its own imports are)."""
    return any(m.split(".")[0] == "torch" for m in imported)


@pytest.mark.timeout(120)
def test_the_coordinator_its_healthcheck_and_status_import_no_torch() -> None:
    # docker-compose.yml runs the healthcheck every 2 s: a torch import made
    # each one cost 2.5 s of CPU (0.3 s without).
    port = free_port()
    for args in (
        ("-m", "server.health", f"127.0.0.1:{port}"),
        ("-m", "server", "--help"),
        ("-m", "ferrogrpc.cli", "status", f"127.0.0.1:{port}"),
    ):
        imported = _imported(*args)
        assert "ferrogrpc.env" in imported, args
        assert not _torch(imported), args
    # import ferrogrpc imports no torch; its torch names load on first use,
    # and the torch.distributed backend is registered once torch is loaded,
    # whichever comes first.
    code = (
        "import sys\n"
        "import ferrogrpc as fg\n"
        "assert 'torch' not in sys.modules\n"
        "assert fg.Backend.__name__ == 'Backend' and fg.testing.stats\n"
        "import torch.distributed as dist\n"
        "assert 'ferrogrpc' in dist.Backend.backend_list\n"
        "try:\n"
        "    fg.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    assert _torch(_imported("-c", code))
    assert not _torch(_imported("-c", "import ferrogrpc"))
    for first, then in (("ferrogrpc", "torch.distributed"), ("torch.distributed", "ferrogrpc")):
        code = (
            f"import {first}, {then}\n"
            "import torch.distributed as dist\n"
            "assert 'ferrogrpc' in dist.Backend.backend_list, dist.Backend.backend_list\n"
        )
        assert _torch(_imported("-c", code)), (first, then)


async def test_a_coordinator_waiting_for_ranks_is_told_from_nothing_listening() -> None:
    # Both used to end in the same DEADLINE_EXCEEDED (issue 55): a
    # coordinator that is up says how many joined, and nothing listening
    # says so; each within the connect timeout (10% and a second).
    connect = 3.0
    coordinator = Coordinator(3)
    port = await coordinator.start("127.0.0.1:0")
    try:
        target = f"127.0.0.1:{port}"
        joiners = [CoordinatorRendezvous(target, timeout=connect) for _ in range(2)]
        start = time.monotonic()
        errors = await asyncio.gather(
            *(j.exchange(None, None, f"h{i}:1", f"n{i}") for i, j in enumerate(joiners)),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - start
        for error in errors:
            assert isinstance(error, fg.RendezvousError), error
            assert f"the coordinator at {target} is up" in str(error), error
            assert "2 of 3 joined (ranks 0, 1)" in str(error), error
        assert elapsed <= connect * 1.1 + 1, elapsed
        await asyncio.gather(*(j.close() for j in joiners))
    finally:
        await coordinator.stop(0)
    nobody = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(fg.RendezvousError, match=f"no coordinator answered at {nobody}"):
        await CoordinatorRendezvous(nobody, timeout=connect).exchange(None, None, "h:1", "n")
    assert time.monotonic() - start <= connect * 1.1 + 1


STATUS_ROW = r"^\s*(\d+|-)\s+(127\.0\.0\.1:\d+)\s+(\d+\.\d)s ago\s+(member|joiner, waiting)$"


@pytest.mark.timeout(150)
def test_status_of_an_elastic_group_shows_its_epoch_members_and_joiners() -> None:
    # `ferrogrpc status` of an elastic group used to print "0/2 joined" and
    # no member (issue 55): the group's members enter epochs, they never
    # Join. A real coordinator process, two elastic members training, then
    # a third process that waits to be admitted at their next step boundary
    # (held back by HOLD_FILE until the status has shown it waiting: polled
    # by a fresh `ferrogrpc status` process each time, a busy host could
    # miss a wait of one PACE).
    import os
    import re
    import subprocess
    import sys
    import tempfile

    from tests.helpers import ROOT, clean_env, spawn_rank

    out_dir = tempfile.TemporaryDirectory()
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = dict(
        clean_env(),
        FERROGRPC_COORDINATOR=target,
        FERROGRPC_HEARTBEAT_TIMEOUT="2",
        OUT_DIR=out_dir.name,
        WORLD="2",
        STEPS="1000",
        PACE="3",
        HOLD_FILE=os.path.join(out_dir.name, "hold"),
    )
    cli = [sys.executable, "-m", "ferrogrpc.cli"]
    coordinator = subprocess.Popen(
        [*cli, "coordinator", "--world-size", "2", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks = []

    def status(up: bool = True) -> tuple[str, list[tuple[str, str, float, str]]]:
        proc = subprocess.run(
            [*cli, "status", target], env=env, capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0 or not up, proc.stdout + proc.stderr
        rows = [
            (m[1], m[2], float(m[3]), m[4])
            for m in re.finditer(STATUS_ROW, proc.stdout, re.MULTILINE)
        ]
        return proc.stdout + (proc.stderr if proc.returncode else ""), rows

    def wait_for(what: str, check: Callable[[str, list[tuple[str, str, float, str]]], bool]) -> str:
        deadline = time.monotonic() + 60
        while True:
            out, rows = status()
            if check(out, rows):
                return out
            outputs = "\n".join(r.stdout[-2000:] for r in ranks)
            assert time.monotonic() < deadline, f"{what}; last status:\n{out}\n{outputs}"
            time.sleep(0.2)

    try:
        # Until the coordinator's process listens (a busy host starts it slowly).
        started = time.monotonic()
        while "UNAVAILABLE" in status(up=False)[0]:
            assert time.monotonic() < started + 60, "the coordinator never listened"
            time.sleep(0.2)
        ranks = [spawn_rank("elastic_train.py", env=env) for _ in range(2)]
        out = wait_for(
            "two members training in epoch 1",
            lambda out, rows: (
                "epoch 1: 2 members, 0 joiners waiting" in out
                and all('"step": 1,' in r.stdout for r in ranks)
            ),
        )
        _, rows = status()
        assert [(r[0], r[3]) for r in rows] == [("0", "member"), ("1", "member")], out
        assert len({r[1] for r in rows}) == 2, out  # each its own address
        assert all(r[2] < 2.0 for r in rows), out  # heartbeats within the timeout
        with open(env["HOLD_FILE"], "w"):
            pass
        ranks.append(spawn_rank("elastic_train.py", env=env))
        out = wait_for(
            "the third process waiting to be admitted",
            lambda out, rows: (
                "epoch 1: 2 members, 1 joiner waiting" in out
                and [r[3] for r in rows] == ["member", "member", "joiner, waiting"]
            ),
        )
        _, joiner, joiner_age, _ = re.findall(STATUS_ROW, out, re.MULTILINE)[-1]
        assert float(joiner_age) < 2.0, out
        os.remove(env["HOLD_FILE"])
        out = wait_for(
            "the joiner admitted in epoch 2",
            lambda out, rows: "epoch 2: 3 members, 0 joiners waiting" in out,
        )
        _, rows = status()
        assert [r[0] for r in rows] == ["0", "1", "2"] and rows[2][1] == joiner, out
    finally:
        for p in [*ranks, coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()
        out_dir.cleanup()


async def test_an_elastic_enter_that_times_out_says_which_of_two_causes() -> None:
    # Issue 55 item 20, for elastic processes: nothing listening, or a
    # coordinator that is up while the epoch does not form in time.
    from ferrogrpc.control.membership_client import MembershipClient

    def client(target: str) -> MembershipClient:
        return MembershipClient(
            target, token=None, tls=None, heartbeat_timeout=2.0, min_world_size=1, timeout=1.5
        )

    nobody = client(f"127.0.0.1:{free_port()}")
    with pytest.raises(fg.RendezvousError, match=r"no coordinator answered at 127\.0\.0\.1"):
        await nobody.enter(rpb.ENTER_JOIN, 0, [], "127.0.0.1:1", "n" * 16, "")
    await nobody.close_channel()
    coordinator = Coordinator(3, heartbeat_timeout=0.2)
    port = await coordinator.start("127.0.0.1:0")
    waiting = client(f"127.0.0.1:{port}")
    try:
        with pytest.raises(fg.RendezvousError, match="the coordinator is up, but the next epoch"):
            await waiting.enter(rpb.ENTER_JOIN, 0, [], "127.0.0.1:1", "n" * 16, "")
    finally:
        await waiting.close_channel()
        await coordinator.stop()
