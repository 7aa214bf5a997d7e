"""Small collectives on one host run on the direct sockets (direct.py): in
the calling thread for a blocking call, in the engine's direct thread for
``async_op=True``; results against float64 references, and every failure
guarantee of the loop's path (mismatch across the threshold, a refusal, a
killed peer, a stopped one) in real processes."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms.exchange_plan import SMALL_BYTES
from ferrogrpc.v1 import collective_pb2 as pb
from tests.helpers import ServedJob, backends, count_exchanges, on_ranks, wait_until

pytestmark = pytest.mark.timeout(90)

WORLD = 3


def _spy(backend: fg.Backend, seen: list[tuple[str, int]]) -> None:
    """Record which thread runs each direct job of ``backend``."""
    direct = backend.peer._engine.direct
    assert direct is not None, "small collectives must go direct (same host, or the TCP mesh)"
    run = direct.run

    def spying(job: Any) -> Any:
        seen.append((threading.current_thread().name, job.seq))
        return run(job)

    direct.run = spying  # type: ignore[method-assign]


def _inputs(rank: int, step: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "tcp-mesh"])
def test_every_direct_kind_against_float64_and_in_the_callers_thread(shm: bool) -> None:
    # On one host the direct sockets are the plane's; with no shared memory
    # (one rank per host) the TCP mesh's. Either way the caller's own thread
    # runs each small collective: no hand-off to the event loop and back.
    group = backends(WORLD, shm=shm)
    threads: list[list[tuple[str, int]]] = [[] for _ in range(WORLD)]
    for backend, seen in zip(group, threads, strict=True):
        _spy(backend, seen)
    try:

        def work(rank: int) -> str:
            b = group[rank]
            me = threading.current_thread().name
            numel = 7
            xs = [_inputs(r, 1, numel) for r in range(WORLD)]
            t = xs[rank].clone()
            b.all_reduce(t)
            torch.testing.assert_close(t, torch.stack(xs).sum(0), rtol=0, atol=1e-12)
            t = xs[rank].clone()
            b.all_reduce(t, "max")
            torch.testing.assert_close(t, torch.stack(xs).amax(0), rtol=0, atol=0)
            t = xs[rank].clone()
            b.all_reduce(t, "mean")
            torch.testing.assert_close(t, torch.stack(xs).mean(0), rtol=0, atol=1e-12)
            t = xs[rank].clone()
            b.broadcast(t, root=2)
            torch.testing.assert_close(t, xs[2], rtol=0, atol=0)
            gathered = b.all_gather(xs[rank])
            for r in range(WORLD):
                torch.testing.assert_close(gathered[r], xs[r], rtol=0, atol=0)
            full = [_inputs(r, 2, 3 * WORLD) for r in range(WORLD)]
            part = b.reduce_scatter(full[rank])
            ref = torch.stack(full).sum(0).tensor_split(WORLD)[rank]
            torch.testing.assert_close(part, ref, rtol=0, atol=1e-12)
            b.barrier()
            # The largest all_reduce that goes direct, and one byte-count over.
            for n in (SMALL_BYTES // 8, SMALL_BYTES // 8 + 1):
                ys = [_inputs(r, 3, n) for r in range(WORLD)]
                t = ys[rank].clone()
                b.all_reduce(t)
                torch.testing.assert_close(t, torch.stack(ys).sum(0), rtol=0, atol=1e-12)
            return me

        callers = on_ranks(work, WORLD)
        for rank, seen in enumerate(threads):
            # Eight direct collectives, each run by the rank's calling thread.
            assert [name for name, _ in seen] == [callers[rank]] * 8, seen
    finally:
        for b in group:
            b.close()


@pytest.mark.parametrize("shm", [True, False], ids=["direct", "grpc"])
def test_gathers_and_scatters_go_in_one_exchange_up_to_a_part_of_small_bytes(
    shm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An all-gather and a reduce-scatter are small by one rank's part: a
    # part of SMALL_BYTES goes in one exchange (direct sockets on one host,
    # one message per pair of ranks over gRPC), one element more goes the
    # long way (shared segments, or rings). Results against float64, exact.
    group = backends(WORLD, shm=shm)
    part = SMALL_BYTES // 8  # float64 elements
    seen: list[list[tuple[str, int]]] = [[] for _ in range(WORLD)]
    exchanges = count_exchanges(monkeypatch)
    if shm:
        for backend, spied in zip(group, seen, strict=True):
            _spy(backend, spied)
    try:

        def work(rank: int) -> None:
            b = group[rank]
            for step, m in enumerate((part, part + 1)):
                xs = [_inputs(r, 10 + step, m) for r in range(WORLD)]
                gathered = torch.empty(WORLD * m, dtype=torch.float64)
                b.all_gather_into_tensor(gathered, xs[rank])
                torch.testing.assert_close(gathered, torch.cat(xs), rtol=0, atol=0)
                # Uneven: the parts are m, m and m - 1 elements.
                full = [_inputs(r, 20 + step, WORLD * m - 1) for r in range(WORLD)]
                out = b.reduce_scatter(full[rank])
                ref = torch.stack(full).sum(0).tensor_split(WORLD)[rank]
                torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)

        on_ranks(work, WORLD)
        # The first size went in one exchange on every rank, the second not.
        if shm:
            assert [len(spied) for spied in seen] == [2] * WORLD, seen
        else:
            assert sorted(exchanges) == sorted([pb.ALL_GATHER, pb.REDUCE_SCATTER] * WORLD)
    finally:
        for b in group:
            b.close()


def test_async_and_blocking_direct_calls_keep_call_order() -> None:
    group = backends(2)
    threads: list[list[tuple[str, int]]] = [[], []]
    for backend, seen in zip(group, threads, strict=True):
        _spy(backend, seen)
    try:

        def work(rank: int) -> None:
            b = group[rank]
            a = torch.full((4,), float(rank + 1))
            c = torch.full((4,), float(10 * (rank + 1)))
            first = b.all_reduce(a, async_op=True)
            # Not its turn until the first has finished: it goes through the
            # loop, and both finish with their own results.
            b.all_reduce(c)
            first.wait()
            assert a.tolist() == [3.0] * 4, a
            assert c.tolist() == [30.0] * 4, c
            # The same tensor twice: the second sees the first's result.
            d = torch.full((2,), float(rank + 1))
            works = [b.all_reduce(d, async_op=True) for _ in range(3)]
            for w in works:
                w.wait()
            assert d.tolist() == [3.0 * 4] * 2, d

        on_ranks(work, 2)
        for seen in threads:
            seqs = [seq for _, seq in seen]
            assert seqs == sorted(seqs), seen
            assert any(name.startswith("ferrogrpc-direct") for name, _ in seen), seen
    finally:
        for b in group:
            b.close()


@pytest.mark.parametrize(
    ("other", "late", "shm"),
    [
        pytest.param(other, late, True, id=f"{other}-{'late' if late else 'together'}-same-host")
        for other in (40_000, 1 << 20)
        for late in (False, True)
    ]
    # Between hosts (the TCP mesh): a disagreeing direct message, and a ring
    # over gRPC whose stream is already there.
    + [
        pytest.param(40_000, False, False, id="40000-together-tcp-mesh"),
        pytest.param(1 << 20, True, False, id="1048576-late-tcp-mesh"),
    ],
)
def test_a_size_across_the_threshold_is_a_protocol_error_on_both_ranks(
    other: int, late: bool, shm: bool
) -> None:
    # Rank 0's all_reduce goes direct; rank 1's goes direct too but
    # disagrees (160 KB), or does not (4 MB: rounds through shared segments
    # on one host, rings over gRPC between hosts). With rank 0 late, rank
    # 1's first message has arrived before rank 0's direct wait begins: it
    # must still be seen, not waited past.
    group = backends(2, shm=shm)
    direct = group[0].peer._engine.direct
    assert direct is not None

    def rank_1s_message_is_here() -> bool:
        # On rank 0's direct socket from rank 1, or (the collective run
        # another way) through the plane's signals or a gRPC stream.
        readable, _, _ = select.select([direct.socks[1]], [], [], 0)
        nxt = group[0].peer._jobs._seq + 1
        return bool(readable) or direct.plane.other_way(1, nxt) is not None

    try:

        def work(rank: int) -> str:
            t = torch.ones(16 if rank == 0 else other)
            if rank == 0 and late:
                wait_until(rank_1s_message_is_here, 10, "rank 1's first message at rank 0")
            start = time.monotonic()
            with pytest.raises(fg.ProtocolError) as info:
                group[rank].all_reduce(t)
            assert time.monotonic() - start < 10
            return str(info.value)

        messages = on_ranks(work, 2)
        for rank, message in enumerate(messages):
            assert f"rank {rank}/2" in message and "all_reduce" in message, message
            assert "16" in message and str(other) in message, message
    finally:
        for b in group:
            b.close()


def _all_to_all(b: fg.Backend, out: torch.Tensor, t: torch.Tensor, **kw: Any) -> torch.Tensor:
    """The Peer's all_to_all_single (``uniform`` is not the Backend's), waited for."""
    call = b.peer.all_to_all_single(out, t, **kw)
    return asyncio.run_coroutine_threadsafe(call, b._loop).result(timeout=60)


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "tcp-mesh"])
def test_a_uniform_all_to_all_goes_direct_up_to_a_part_of_small_bytes(shm: bool) -> None:
    # The quantized all-reduce's all-to-all promises equal parts of one size
    # on every rank (uniform): its descriptor carries the size, so a small
    # one runs on the direct sockets as the gather after it does. A part of
    # one element more, or an all-to-all without the promise, goes as gRPC
    # messages. Results exact against the inputs' rows; a rank whose size
    # differs is named by both.
    group = backends(WORLD, shm=shm)
    kinds: list[list[int]] = [[] for _ in range(WORLD)]
    for backend, spied in zip(group, kinds, strict=True):
        direct = backend.peer._engine.direct
        assert direct is not None
        direct.run = lambda job, run=direct.run, spied=spied: (spied.append(job.kind), run(job))[1]  # type: ignore[method-assign]
    part = SMALL_BYTES // 8  # float64 elements
    try:

        def work(rank: int) -> None:
            b = group[rank]
            for step, (m, uniform) in enumerate(((part, True), (part + 1, True), (part, False))):
                xs = [_inputs(r, 30 + step, WORLD * m) for r in range(WORLD)]
                out = torch.empty(WORLD * m, dtype=torch.float64)
                _all_to_all(b, out, xs[rank], uniform=uniform)
                rows = [xs[r][rank * m : (rank + 1) * m] for r in range(WORLD)]
                assert torch.equal(out, torch.cat(rows)), (rank, m, uniform)
            # The int8 all-reduce's two collectives, both direct.
            t = _inputs(rank, 40, 1000).float()
            b.all_reduce(t, wire_dtype=torch.int8)
            with pytest.raises(fg.ConfigError, match="uniform all_to_all has equal splits"):
                _all_to_all(
                    b, torch.empty(WORLD), torch.ones(WORLD), in_splits=[1] * WORLD, uniform=True
                )
            # Rank 0's parts go direct, the others' as gRPC messages.
            m = 16 if rank == 0 else part + 1
            with pytest.raises(fg.ProtocolError) as info:
                t = torch.ones(WORLD * m, dtype=torch.float64)
                _all_to_all(b, torch.empty_like(t), t, uniform=True)
            assert "numel" in str(info.value) and "all_to_all" in str(info.value), info.value

        on_ranks(work, WORLD)
        expected = [pb.ALL_TO_ALL, pb.ALL_TO_ALL, pb.ALL_GATHER]
        assert kinds[1:] == [expected] * (WORLD - 1), kinds
        assert kinds[0] == [*expected, pb.ALL_TO_ALL], kinds  # rank 0's small mismatched one
    finally:
        for b in group:
            b.close()


def _ask(job: ServedJob, ranks: list[int], command: str) -> list[str]:
    for r in ranks:
        proc = job.procs[r]
        assert proc.stdin is not None
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    return [job._line(r) for r in ranks]


@pytest.mark.timeout(120)
def test_a_refusal_then_direct_calls_go_on(report: Callable[[str], None]) -> None:
    # Rank 1 refuses (MEAN of ints); rank 0's message for that collective is
    # left unread on rank 1's direct socket, and dropped by its next call.
    with ServedJob(2) as job:
        assert all(a.startswith("OK") for a in job.command("small 5"))
        answers = job.send(["all_reduce_int sum", "all_reduce_int mean"])
        assert answers[0].startswith("ConfigError [rank 0/2 all_reduce#"), answers
        assert "rank 1's own argument checks" in answers[0], answers
        for _ in range(3):
            for answer in job.command("small 1000"):
                word, error = answer.split()
                assert word == "OK" and float(error) < 1e-12, answers
        report("direct path: a refusal, then three direct all_reduces, all correct")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["same-host", "tcp-mesh"])
def test_a_killed_rank_is_named_in_a_direct_wait(shm: str, report: Callable[[str], None]) -> None:
    with ServedJob(3, FERROGRPC_SHM=shm) as job:
        for answer in job.command("small 3"):
            assert answer.startswith("OK"), answer
        os.kill(job.pids[2], signal.SIGKILL)
        job.procs[2].wait()
        start = time.monotonic()
        answers = _ask(job, [0, 1], "small 3")
        took = time.monotonic() - start
        for rank, answer in enumerate(answers):
            assert answer.startswith("PeerError"), answers
            assert f"rank {rank}/3" in answer and "peer 2" in answer, answers
            assert "gone" in answer, answers
        assert took < 10, took
        path = "same host" if shm == "1" else "TCP mesh"
        report(f"direct path ({path}): a SIGKILLed rank named by the others in {took:.2f} s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["direct", "grpc"])
def test_a_stopped_rank_is_named_as_stuck(shm: str, report: Callable[[str], None]) -> None:
    # Over gRPC (FERROGRPC_SHM=0) the same small exchange runs on the event
    # loop, where its watchdog starts only once it has waited a tick.
    idle = 1.0
    with ServedJob(3, FERROGRPC_IDLE_TIMEOUT=str(idle), FERROGRPC_SHM=shm) as job:
        for answer in job.command("small 3"):
            assert answer.startswith("OK"), answer
        os.kill(job.pids[2], signal.SIGSTOP)
        try:
            start = time.monotonic()
            answers = _ask(job, [0, 1], "small 3")
            took = time.monotonic() - start
        finally:
            os.kill(job.pids[2], signal.SIGKILL)
        for answer in answers:
            assert answer.startswith("CollectiveTimeoutError"), answers
            assert "peer 2" in answer, answers
        assert "stuck" in answers[0] or "stuck" in answers[1], answers
        # Named after about an idle timeout and a ping's, not the deadline.
        assert took < 4 * idle + 5, took
        path = "direct path" if shm == "1" else "gRPC"
        report(f"{path}: a SIGSTOPped rank named as stuck in {took:.2f} s (idle {idle} s)")


def test_a_peer_that_finished_and_closed_has_sent_all_it_had_to() -> None:
    # Ranks 0 and 2 finish and close while rank 1 has not read their
    # messages yet (it pauses after sending): rank 1 still completes, with
    # the right sum, instead of reporting a closed peer as gone.
    group = backends(3)
    direct = group[1].peer._engine.direct
    assert direct is not None
    send = direct._send
    closed: list[int] = []

    def slow_send(job: Any, dst: int, desc: bytes, view: memoryview, crc: int) -> None:
        send(job, dst, desc, view, crc)
        if dst == 2:  # the last one: rank 1 reads only once the others closed
            wait_until(lambda: len(closed) == 2, 20, "ranks 0 and 2 closed")

    direct._send = slow_send  # type: ignore[method-assign]

    def work(rank: int) -> list[float]:
        t = torch.full((3,), float(rank + 1))
        group[rank].all_reduce(t)
        if rank != 1:
            group[rank].close()
            closed.append(rank)
        return t.tolist()

    try:
        assert on_ranks(work, 3) == [[6.0] * 3] * 3
    finally:
        for b in group:
            b.close()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sending_each_other_more_than_a_socket_holds_never_wait_on_each_other(
    world: int,
) -> None:
    # Socket buffers cut to a few KiB: every rank's 256 KiB messages fill
    # them at once, and each must read the others' while it sends its own;
    # at world 3, not only the one it sends to (each rank blocked on the
    # next one's socket is a cycle).
    import socket

    group = backends(world, timeouts=fg.Timeouts(idle=5, collective=20))
    for b in group:
        direct = b.peer._engine.direct
        assert direct is not None
        for sock in direct.socks.values():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:

        def work(rank: int) -> float:
            start = time.monotonic()
            for step in range(3):
                xs = [_inputs(r, step, SMALL_BYTES // 8) for r in range(world)]
                t = xs[rank].clone()
                group[rank].all_reduce(t)
                torch.testing.assert_close(t, torch.stack(xs).sum(0), rtol=0, atol=1e-12)
                gathered = torch.empty(world * xs[0].numel(), dtype=torch.float64)
                group[rank].all_gather_into_tensor(gathered, xs[rank])
                torch.testing.assert_close(gathered, torch.cat(xs), rtol=0, atol=0)
            return time.monotonic() - start

        took = on_ranks(work, world)
        assert max(took) < 5, took  # not an idle timeout's stall
    finally:
        for b in group:
            b.close()


def test_a_socket_between_hosts_wakes_once_a_message_has_all_come() -> None:
    """[Note: one wake-up per message between hosts]: once a message's head
    has come, its socket turns readable only when the rest has (SO_RCVLOWAT
    set to the bytes missing_bytes counts), not per burst of packets."""
    import socket
    import struct

    from ferrogrpc.algorithms.direct import _HEAD, missing_bytes

    assert missing_bytes(bytearray()) == 1
    assert missing_bytes(bytearray(5)) == _HEAD.size - 5
    head = _HEAD.pack(100_000, 7, 0, 0)
    assert missing_bytes(bytearray(head + bytes(10))) == 100_000 - 10
    assert missing_bytes(bytearray(head + bytes(100_000))) == 1  # whole: the next one's
    assert struct.calcsize(_HEAD.format) == _HEAD.size

    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    server.close()
    try:
        sender.sendall(head + bytes(10))
        buf = bytearray()
        while len(buf) < len(head) + 10:
            buf += receiver.recv(4096)
        want = missing_bytes(buf)
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        piece = (100_000 - 10) // 5
        for i in range(5):
            size = piece if i < 4 else 100_000 - 10 - 4 * piece
            sender.sendall(bytes(size))
            readable, _, _ = select.select([receiver], [], [], 0.1)
            # Not readable until the last piece: the bytes are there, the
            # message is not.
            assert bool(readable) == (i == 4), i
        got = receiver.recv(200_000, socket.MSG_DONTWAIT)
        assert len(got) == want
        # The sender going away wakes the receiver whatever the low mark.
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1 << 20)
        sender.close()
        readable, _, _ = select.select([receiver], [], [], 5)
        assert readable and receiver.recv(16) == b""
    finally:
        sender.close()
        receiver.close()
