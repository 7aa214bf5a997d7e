"""Issue 57: a SIGKILLed elastic process is dropped from its epoch at once
through its Watch call ([Note: a stream for a lifetime] in
control/liveness.py), not after the heartbeat timeout; a stopped process,
a live one whose call broke, and one that left are not."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from ferrogrpc.control.coordinator import Coordinator
from ferrogrpc.control.coordinator_client import SERVICE
from ferrogrpc.control.liveness import GRACE_S, Watcher
from ferrogrpc.v1 import rendezvous_pb2 as rpb

from .helpers import ROOT

HEARTBEAT_S = 30.0  # nothing here may wait for it
PEERS = [c * 32 for c in "abc"]

# A process that holds a Watch call for ``peer`` and says so.
CHILD = """
import sys, time, grpc
from ferrogrpc.control.liveness import Watcher
from ferrogrpc.v1 import rendezvous_pb2 as rpb
channel = grpc.insecure_channel(sys.argv[1])
stub = channel.unary_stream("/{service}/Watch", rpb.HeartbeatRequest.SerializeToString, None)
Watcher(lambda: stub(rpb.HeartbeatRequest(peer_id=sys.argv[2])))
print("watching", flush=True)
time.sleep(600)
"""


def _child(target: str, peer: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD.format(service=SERVICE), target, peer],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
    )


def _enter(c: Coordinator, peer: str) -> asyncio.Task[Any]:
    request = rpb.EnterRequest(peer_id=peer, address=f"{peer[:4]}:1", nonce="n" * 16)
    return asyncio.ensure_future(c.membership.enter(request))


def _stub(target: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(target)
    stub = channel.unary_stream(f"/{SERVICE}/Watch", rpb.HeartbeatRequest.SerializeToString, None)
    return channel, stub


@contextlib.asynccontextmanager
async def _epoch_of_three() -> AsyncIterator[
    tuple[Coordinator, subprocess.Popen[bytes], list[Watcher]]
]:
    """A coordinator whose first epoch holds PEERS: a and b are live
    processes of this one, each with its Watch call; c is a child process
    with its own. Everything is stopped on the way out."""
    coordinator = Coordinator(3, heartbeat_timeout=HEARTBEAT_S)
    coordinator.membership.quiet = 0.0
    port = await coordinator.start("127.0.0.1:0")
    target = f"127.0.0.1:{port}"
    child = _child(target, PEERS[2])
    channel, stub = _stub(target)
    watchers: list[Watcher] = []
    try:
        await asyncio.gather(*(_enter(coordinator, p) for p in PEERS))
        assert coordinator.membership.epoch == 1 and coordinator.membership.members == PEERS
        for peer in PEERS[:2]:
            watchers.append(Watcher(lambda p=peer: stub(rpb.HeartbeatRequest(peer_id=p))))
        assert child.stdout is not None
        assert await asyncio.to_thread(child.stdout.readline) == b"watching\n"
        await _until(lambda: all(p in coordinator.watches._calls for p in PEERS), 10)
        yield coordinator, child, watchers
    finally:
        for watcher in watchers:
            watcher.close()
        channel.close()
        if child.poll() is None:
            child.kill()
        child.wait()
        await coordinator.stop(0)


async def _until(what: Any, timeout: float) -> float:
    began = time.monotonic()
    while not what():
        assert time.monotonic() - began < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - began


@pytest.mark.timeout(60)
async def test_a_killed_process_is_dropped_at_once_a_stopped_one_is_not() -> None:
    async with _epoch_of_three() as (coordinator, child, watchers):
        m = coordinator.membership
        # b's call breaks (cancelled under it): it opens another within the
        # grace, and stays.
        with watchers[1]._lock:
            watchers[1]._call.cancel()
        # c stopped: its connection stays open, and so does its place.
        child.send_signal(signal.SIGSTOP)
        await asyncio.sleep(GRACE_S + 1.0)
        assert m.round is None and m.epoch == 1, m.round
        child.send_signal(signal.SIGCONT)

        # a leaves (its backend closed): its call's end then says nothing.
        m.heartbeat(rpb.HeartbeatRequest(peer_id=PEERS[0], leaving=True))
        watchers.pop(0).close()
        await asyncio.sleep(GRACE_S + 0.5)
        assert m.round is None and m.epoch == 1, m.round

        # c SIGKILLed: dropped (a RECOVER round without rank 2) within the
        # grace, far inside the heartbeat timeout.
        child.kill()
        took = await _until(lambda: m.round is not None, GRACE_S + 2.0)
        assert m.round is not None and m.round.dropped == [2], m.round.dropped
        assert took < GRACE_S + 1.0 < HEARTBEAT_S, took


@pytest.mark.timeout(30)
async def test_a_coordinator_without_the_watch_call_stops_the_asking() -> None:
    # An older coordinator (no Watch method): the process's watcher thread
    # ends after one UNIMPLEMENTED, and close() is immediate.
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel, stub = _stub(f"127.0.0.1:{port}")
    try:
        watcher = Watcher(lambda: stub(rpb.HeartbeatRequest(peer_id=PEERS[0])))
        await _until(lambda: not watcher._thread.is_alive(), 10)
        watcher.close()
    finally:
        channel.close()
        await server.stop(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["death", "round"])
async def test_a_death_during_a_recover_round_waits_no_grace(
    first: str, report: Callable[[str], None]
) -> None:
    # A member's collective failed (its survivors enter RECOVER without
    # naming anyone: they cannot tell a dead peer from one that moved on),
    # and a member's Watch call ended: that member is the likely cause, and
    # is dropped at once, not after the grace; whether the call ended
    # before the round opened ("death", hurry) or after ("round", urgent).
    recovering: list[asyncio.Task[Any]] = []

    def recover(m: Any, peer: str) -> None:
        request = rpb.EnterRequest(
            peer_id=peer, address=f"{peer[:4]}:2", nonce="m" * 16, epoch=1, reason=rpb.ENTER_RECOVER
        )
        recovering.append(asyncio.ensure_future(m.enter(request)))

    async with _epoch_of_three() as (coordinator, child, _):
        m = coordinator.membership
        if first == "death":
            child.kill()
            await _until(lambda: PEERS[2] in coordinator.watches._pending, 5)
            began = time.monotonic()
            recover(m, PEERS[0])
        else:
            recover(m, PEERS[0])
            await _until(lambda: m.round is not None, 5)
            assert m.round is not None and m.round.dropped == [], m.round.dropped
            began = time.monotonic()
            child.kill()
        recover(m, PEERS[1])
        formed = await asyncio.wait_for(asyncio.gather(*recovering), 10)
        took = time.monotonic() - began
        assert m.epoch == 2 and m.members == PEERS[:2], m.members
        assert [r.world_size for r in formed] == [2, 2]
        assert took < GRACE_S / 2, took
        report(
            f"liveness: a SIGKILL during a RECOVER round ({first} first): "
            f"the epoch formed {took:.3f}s after"
        )
