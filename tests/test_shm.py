"""The same-host plane's resources: segments are anonymous memory (memfd)
that no process can hold once the job's processes are gone, SIGKILL
included; close() releases them in a live process (a thread unmaps them
just after, without holding close up); FERROGRPC_SHM=0 turns
the plane off."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import resource
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.samehost import plane as local
from ferrogrpc.samehost.segment import Segment, Spare
from tests.helpers import RANKS, Zygote, async_wait_until, free_port, rank_env, spawn_piped

pytestmark = pytest.mark.timeout(90)

_MEMFD = re.compile(r"^\S+ \S+ \S+ \S+ (\d+)\s+/memfd:ferrogrpc")


def _segments(pid: int | str) -> set[int]:
    """Inodes of the ferrogrpc segments a process maps or holds open."""
    found: set[int] = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                m = _MEMFD.match(line)
                if m:
                    found.add(int(m.group(1)))
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                if os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:ferrogrpc"):
                    found.add(os.stat(f"{fd_dir}/{fd}").st_ino)
            except OSError:
                continue
    except OSError:
        pass  # the process is gone (or not ours to read)
    return found


def _anyone_holding(inodes: set[int]) -> list[str]:
    holders = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and _segments(pid) & inodes:
            holders.append(pid)
    return holders


def test_segments_are_gone_once_sigkilled_ranks_are() -> None:
    world = 4
    port = free_port()
    shm_files = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    piped = [
        spawn_piped([str(RANKS / "shm_loop.py")], rank_env(rank, world, port))
        for rank in range(world)
    ]
    procs = [proc for proc, _ in piped]
    try:
        for _, out in piped:
            line = out.readline()
            assert line.startswith("ready") and "shared memory" in line, line
        inodes: set[int] = set()
        for proc in procs:
            held = _segments(proc.pid)
            # Its own segment and its three peers'.
            assert len(held) == world, held
            inodes |= held
        assert len(inodes) == world
        # Mid-collective, every rank at once: nothing runs any clean-up.
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait(timeout=30)
    finally:
        for proc, out in piped:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
    # No process maps or holds any of them: the kernel has freed them. And
    # nothing was ever named in /dev/shm for a later job to clean up.
    assert _anyone_holding(inodes) == []
    if os.path.isdir("/dev/shm"):
        assert {f for f in os.listdir("/dev/shm") if "ferrogrpc" in f} <= shm_files


async def test_close_releases_segments_in_a_live_process() -> None:
    before = _segments("self")
    async with fg.testing.local_group(3, transport="shm") as peers:
        assert all(p.data_path == "shared memory" for p in peers)
        during = _segments("self") - before
        # Three segments, each mapped by its three ranks in this one process.
        assert len(during) == 3, during
    gc.collect()
    # Unmapped by a thread just after close ([Note: unmapping in the
    # background]): gone within a moment, not at once.
    await async_wait_until(lambda: _segments("self") - before == set(), 5, "segments released")


async def test_close_does_not_wait_for_the_unmapping(monkeypatch: pytest.MonkeyPatch) -> None:
    # An unmapping held up for seconds: close() returns at once all the same
    # (an elastic group's change of epoch waits for it), and the segments go
    # when the unmapping ends.
    go = threading.Event()
    unmap = local.unmap

    def held(maps: list[Any], fd: int) -> None:
        go.wait(20)
        unmap(maps, fd)

    monkeypatch.setattr(local, "unmap", held)
    before = _segments("self")
    async with fg.testing.local_group(2, transport="shm") as peers:
        assert all(p.data_path == "shared memory" for p in peers)
        began = time.monotonic()
    closing = time.monotonic() - began
    gc.collect()
    try:
        assert closing < 3.0, closing
        assert len(_segments("self") - before) == 2
    finally:
        go.set()
    await async_wait_until(lambda: _segments("self") - before == set(), 5, "segments released")


def _faults_writing(t: Any) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_touched_segment_faults_no_page_on_its_first_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Segment.touch maps every page in: with one madvise where the kernel
    # has MADV_POPULATE_WRITE, else (an advice it refuses) by writing them.
    from ferrogrpc.samehost import segment

    nbytes = local.segment_bytes()
    pages = nbytes // 4096
    for advice in (segment._MADV_POPULATE_WRITE, -1):
        monkeypatch.setattr(segment, "_MADV_POPULATE_WRITE", advice)
        touched = Segment(nbytes).touch()
        try:
            assert _faults_writing(touched.tensor) < 0.05 * pages, advice
        finally:
            touched.release()


async def test_a_spare_segment_is_made_ahead_and_a_plane_takes_it() -> None:
    # [Note: a segment made ahead]: a Spare's segment is written before a
    # plane takes it, so that the plane's first collective faults no page
    # of it in (a fresh one faults every page); one of another size is
    # released, one not made yet is taken once it is, and close releases
    # every one, made or still being made.
    nbytes = local.segment_bytes()
    pages = nbytes // 4096
    before = _segments("self")
    fresh = Segment(nbytes)
    assert _faults_writing(fresh.tensor) >= 0.9 * pages  # the reference
    fresh.release()

    spare = Spare()
    spare.prepare(nbytes)
    await async_wait_until(lambda: all(f.done() for f in spare._held), 10, "a spare made")
    plane = local.LocalPlane(secrets.token_hex(8), spare)
    try:
        assert _faults_writing(plane.segment) < 0.05 * pages
        assert spare.take(nbytes) is None  # taken once
    finally:
        await plane.close()
    spare.take(nbytes).release()  # the closed plane's, handed back

    spare.prepare(nbytes)
    await async_wait_until(lambda: all(f.done() for f in spare._held), 10, "a spare made")
    assert spare.take(nbytes // 2) is None and spare._held == []  # another size: released
    go = threading.Event()
    real_touch = Segment.touch

    def slow_touch(segment: Segment) -> Segment:
        go.wait(10)
        return real_touch(segment)

    Segment.touch = slow_touch  # type: ignore[method-assign]
    try:
        spare.prepare(nbytes, count=3)
        assert len(spare._held) == 2  # at most HELD
        assert spare.take(nbytes) is None  # not made yet: still held
        go.set()
        await async_wait_until(lambda: all(f.done() for f in spare._held), 10, "spares made")
        taken = spare.take(nbytes)
        assert taken is not None and len(spare._held) == 1
        taken.release()
        spare.drop()  # released; the spare stays open
        assert spare._held == []
        spare.give(Segment(nbytes))
        assert len(spare._held) == 1
        go.clear()
        spare.prepare(nbytes, count=2)  # one held, one being made
        spare.close()  # both released, the second once made
        spare.prepare(nbytes)  # nothing more after close
        assert spare._held == []
        extra = Segment(4096)
        assert not spare.give(extra)  # closed: the caller releases it
        extra.release()
    finally:
        Segment.touch = real_touch  # type: ignore[method-assign]
        go.set()
    gc.collect()
    await async_wait_until(lambda: _segments("self") - before == set(), 10, "segments released")


async def test_a_closed_planes_segment_is_handed_back_and_the_next_plane_takes_it() -> None:
    # [Note: a segment handed back]: an elastic member's closed epoch hands
    # its own segment, already faulted in, to the Spare; its next epoch
    # after that takes the same memory and faults none of it in. A spare
    # that holds HELD already does not keep it: it is unmapped.
    nbytes = local.segment_bytes()
    pages = nbytes // 4096
    before = _segments("self")
    spare = Spare()
    first = local.LocalPlane(secrets.token_hex(8), spare)
    inode = os.fstat(first.fd).st_ino
    assert _faults_writing(first.segment) >= 0.9 * pages  # none was ready: a fresh one
    await first.close()
    assert len(spare._held) == 1
    second = local.LocalPlane(secrets.token_hex(8), spare)
    try:
        assert os.fstat(second.fd).st_ino == inode
        assert _faults_writing(second.segment) < 0.05 * pages
        assert spare._held == []
        spare.prepare(nbytes, count=2)
        await async_wait_until(lambda: all(f.done() for f in spare._held), 10, "spares made")
    finally:
        await second.close()
    assert len(spare._held) == 2
    assert inode not in {os.fstat(f.result().fd).st_ino for f in spare._held}
    await async_wait_until(lambda: inode not in _segments("self"), 10, "the third unmapped")
    spare.close()
    gc.collect()
    await async_wait_until(lambda: _segments("self") - before == set(), 10, "segments released")


def test_shm_off_moves_every_byte_over_grpc(tmp_path: Path) -> None:
    program = tmp_path / "two_ranks.py"
    program.write_text(
        "import ferrogrpc as fg, torch\n"
        "b = fg.init_backend()\n"
        "t = torch.ones(1000); b.all_reduce(t)\n"
        "s = fg.testing.stats(b)\n"
        "print(b.data_path, s.bytes_received > 0, s.bytes_local, float(t[0]))\n"
        "b.close()\n"
    )
    for shm, expected in (("0", "grpc True 0 2.0"), ("1", "shared memory False")):
        port = free_port()
        procs = [
            Zygote.get().spawn([str(program)], rank_env(rank, 2, port, FERROGRPC_SHM=shm))
            for rank in range(2)
        ]
        deadline = time.monotonic() + 60
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            assert proc.returncode == 0, out
            assert out.strip().splitlines()[-1].startswith(expected), out


async def test_a_duplicate_first_message_is_a_protocol_error_not_a_vanished_rank() -> None:
    # Rank 1 begins collective #7 twice on the plane before rank 0 reads
    # either: rank 0's waits then fail naming rank 1 for what it did, not
    # as "gone" (its process is alive; a wrong diagnosis sends users to
    # look for a crash).
    async with fg.testing.local_group(2, transport="shm") as peers:
        plane0, plane1 = (p._plane for p in peers)
        assert plane0 is not None and plane1 is not None
        plane1.send(local.BEGIN, 7, b"")
        plane1.send(local.BEGIN, 7, b"")
        with pytest.raises(fg.ProtocolError, match="rank 1 began collective #7 twice") as info:
            await asyncio.wait_for(plane0.first(1, 8), 10)
        assert info.value.peer == 1


async def test_a_rank_that_closes_fails_only_the_waits_for_it() -> None:
    # Rank 0 finishes and closes its plane while rank 1 still waits for
    # rank 2: that wait goes on (rank 0 sent all it had to); a wait for
    # rank 0 fails at once, naming it. Before, every wait on rank 1's plane
    # failed with "rank 0 ... is gone" (a flake in FSDP's last collective).
    async with fg.testing.local_group(3, transport="shm") as peers:
        planes = [p._plane for p in peers]
        assert all(plane is not None for plane in planes)
        p0, p1, p2 = planes
        assert p0 is not None and p1 is not None and p2 is not None
        waiting = asyncio.ensure_future(p1.first(2, 900))
        await p0.close()
        await async_wait_until(lambda: p1.links[0].gone is not None, 10, "rank 0 gone")
        assert not waiting.done()
        p2.send(local.BEGIN, 900, b"desc")
        assert await asyncio.wait_for(waiting, 10) == (local.BEGIN, b"desc")
        with pytest.raises(fg.PeerError, match="rank 0 on this host is gone") as info:
            await asyncio.wait_for(p1.first(0, 901), 10)
        assert info.value.peer == 0
        assert p1.failed is None


async def test_close_closes_every_same_host_socket_at_once() -> None:
    # Not left to the garbage collector: the sockets are held here, so a
    # socket close() forgot would still be open after it.
    async with fg.testing.local_group(3, transport="shm") as peers:
        planes = [p._plane for p in peers]
        socks = []
        for plane in planes:
            assert plane is not None
            socks += [plane.listener, plane.wake_r]
            for link in plane.links.values():
                assert link.direct is not None
                socks += [link.direct, link.writer.get_extra_info("socket")]
        assert all(s.fileno() >= 0 for s in socks[1:2])  # open while the job runs
    open_after = [s for s in socks if s.fileno() >= 0]
    assert not open_after, open_after
    assert all(plane is not None and plane.fd == -1 for plane in planes)  # the segments too


# Issue 56 items 24-25: a rank whose collective fails on the same-host plane
# tells its host's other ranks through the plane itself (an ABORT signal),
# at once. Its reports over gRPC are held back here (they would reach the
# others as fast on one machine), so that only the plane can tell them.
FAULTS: dict[str, type[Exception]] = {"found": fg.ProtocolError, "torch": RuntimeError}


def _injected(kind: str, at: list[float]) -> Exception:
    at.append(time.monotonic())
    if FAULTS[kind] is fg.ProtocolError:
        return fg.ProtocolError("injected: rank 1 found bad data", rank=1)
    return RuntimeError("injected: a torch error on rank 1")


def _hold_grpc_reports(peer: fg.Peer) -> None:
    async def held(dst: int, message: bytes, timeout: float) -> None:
        pass  # never delivered

    peer._ctx.transport.send_abort = held  # type: ignore[method-assign]


async def _fail_on_rank_1(
    peers: list[fg.Peer], numel: int, op: str = "all_reduce"
) -> tuple[list[Any], list[float]]:
    """Every rank's all_reduce of ``numel`` ones (or all_to_all: an equal
    part of them to every rank): its error (or result) and when it ended."""
    _hold_grpc_reports(peers[1])

    def call(peer: fg.Peer) -> Any:
        if op == "all_reduce":
            return peer.all_reduce(torch.ones(numel))
        return peer.all_to_all_single(torch.empty(numel), torch.ones(numel))

    async def one(peer: fg.Peer) -> tuple[Any, float]:
        try:
            result: Any = await call(peer)
        except fg.FerroGrpcError as exc:
            result = exc
        except RuntimeError as exc:  # (rank 1's own error, where it raises it as it is)
            result = exc
        return result, time.monotonic()

    async with asyncio.timeout(30):
        ended = await asyncio.gather(*(one(p) for p in peers))
    return [r for r, _ in ended], [t for _, t in ended]


def _assert_told_through_the_plane(
    peers: list[fg.Peer], results: list[Any], ended: list[float], at: list[float], host: list[int]
) -> None:
    assert len(at) == 1, at
    for r in host:
        err = results[r]
        assert isinstance(err, fg.FerroGrpcError), (r, err)
        assert "rank 1 reported" in str(err) and "injected" in str(err), (r, err)
        assert ended[r] - at[0] < 1.0, (r, ended[r] - at[0], err)
        plane = peers[r]._plane
        assert plane is not None and plane.failed is not None, r
        assert "rank 1 reported" in str(plane.failed), (r, plane.failed)
    for r, res in enumerate(results):
        assert isinstance(res, Exception), (r, res)  # nobody returns a result


TIMEOUTS = fg.Timeouts(collective=15, idle=8, connect=20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["all_reduce", "all_to_all"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_shared_memory_collective_failing_mid_round_aborts_the_plane(
    fault: str, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 56 item 24: rank 1 fails between two rounds of an all-reduce
    # through the shared segments (at its second "written" signal); the
    # same inside an all_to_all's rounds (its parts of 128 KiB each go
    # through the slots).
    monkeypatch.setattr(local, "SLOT_BYTES", 4096)
    armed, at, written = [False], [], [0]
    send = local.LocalPlane.send

    def faulty(self: local.LocalPlane, kind: int, arg: int, payload: bytes = b"") -> None:
        if armed[0] and self.me is not None and self.me.rank == 1 and kind == local.WRITTEN:
            written[0] += 1
            if written[0] == 2:
                raise _injected(fault, at)
        send(self, kind, arg, payload)

    monkeypatch.setattr(local.LocalPlane, "send", faulty)
    async with fg.testing.local_group(3, transport="shm", timeouts=TIMEOUTS) as peers:
        armed[0] = True
        results, ended = await _fail_on_rank_1(peers, 3 << 15, op)
        _assert_told_through_the_plane(peers, results, ended, at, [0, 2])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("path", ["direct", "one exchange"])
async def test_a_small_collective_failing_on_shared_memory_aborts_the_plane(
    path: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 56 item 25: rank 1 fails before its first message of a small
    # all-reduce: on one host's direct sockets (direct.py), and in one
    # exchange where a host's ranks meet on its plane and another host's
    # over gRPC (one_exchange.py). Its host's other ranks wait for that
    # message; the plane's abort must end the wait.
    from ferrogrpc.algorithms import direct

    armed, at = [False], []
    if path == "direct":
        dsend = direct.Direct._send

        def faulty_direct(self: direct.Direct, job: Any, dst: int, *rest: Any) -> None:
            if armed[0] and self.me.rank == 1:
                raise _injected(fault, at)
            dsend(self, job, dst, *rest)

        monkeypatch.setattr(direct.Direct, "_send", faulty_direct)
        hosts = None
    else:
        small = local.LocalPlane.send_small

        def faulty_small(self: local.LocalPlane, rank: int, *rest: Any) -> None:
            if armed[0] and self.me is not None and self.me.rank == 1:
                raise _injected(fault, at)
            small(self, rank, *rest)

        monkeypatch.setattr(local.LocalPlane, "send_small", faulty_small)
        hosts = ["a", "a", "a", "b"]  # rank 3: another host
    world = 3 if hosts is None else len(hosts)
    options: dict[str, Any] = {"hosts": hosts} if hosts else {}
    async with fg.testing.local_group(
        world, transport="shm", timeouts=TIMEOUTS, **options
    ) as peers:
        armed[0] = True
        results, ended = await _fail_on_rank_1(peers, 10)
        _assert_told_through_the_plane(peers, results, ended, at, [0, 2])
