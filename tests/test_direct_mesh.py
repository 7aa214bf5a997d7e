"""The TCP mesh (runtime/direct_mesh.py): direct sockets between hosts.

Small collectives between ranks that share no memory run from the
caller's thread on one TCP connection per pair (issue 29, item 11). What
they compute, and how they fail, is checked with the same-host direct
path's tests (test_direct.py, the ``grpc`` cases). Here: the handshake
admits only the group's ranks and never waits on a stranger, a group
whose ranks cannot reach each other's mesh ports goes on over gRPC, and
a corrupted message is named.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import types
from typing import Any

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.errors import Identity
from ferrogrpc.runtime import direct_mesh
from ferrogrpc.runtime.direct_mesh import TcpMesh
from tests.helpers import backends, on_ranks

pytestmark = pytest.mark.timeout(60)

CREDENTIALS = ["cred-of-rank-0", "cred-of-rank-1"]


def _mesh(rank: int, credentials: list[str] = CREDENTIALS) -> TcpMesh:
    me = Identity(rank, 2, ["127.0.0.1:1", "127.0.0.1:2"])
    return TcpMesh(types.SimpleNamespace(identity=me, checksum=None), credentials)  # type: ignore[arg-type]


async def _stranger(port: int, hello: bytes | None) -> bytes:
    """Connect to ``port``, send ``hello`` (None: nothing), and return what
    the listener sends before it hangs up (b"" if nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if hello is not None:
            writer.write(hello)
            await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(4096), 5)
        except TimeoutError:
            return b"(still open)"
    finally:
        writer.close()


async def test_a_silent_connection_delays_nobody_and_a_forged_rank_is_refused() -> None:
    a, b = _mesh(0), _mesh(1)
    port_b = b.listen("127.0.0.1")
    port_a = a.listen("127.0.0.1")
    # A stranger connects to rank 1's listener first and says nothing; a
    # second claims to be rank 0 without rank 0's credential.
    silent = asyncio.ensure_future(_stranger(port_b, None))
    await asyncio.sleep(0.05)
    forger = _mesh(0, ["not-rank-0s", CREDENTIALS[1]])
    forged = asyncio.ensure_future(forger._dial(1, "127.0.0.1", port_b))
    await asyncio.sleep(0.05)
    start = time.monotonic()
    formed = await asyncio.gather(a.connect([port_a, port_b]), b.connect([port_a, port_b]))
    took = time.monotonic() - start
    assert formed == [True, True]
    assert took < direct_mesh.HANDSHAKE_S / 2, f"the ranks waited on a stranger: {took:.2f} s"
    # Both strangers are hung up on, with nothing more said: the forger
    # either during its handshake, or right after its (unchecked) proof.
    assert await silent == b""
    try:
        await forged
    except (ConnectionError, OSError):
        pass
    else:
        sock = forger.socks[1]
        sock.setblocking(True)
        sock.settimeout(5)
        assert sock.recv(16) == b"", "the listener kept a connection that failed its proof"
    # The real pair works: rank 0's bytes reach rank 1.
    a.socks[1].sendall(b"ping")
    b.socks[0].setblocking(True)
    assert b.socks[0].recv(4) == b"ping"
    for m in (a, b, forger):
        m.close()


async def test_a_hello_for_another_rank_or_without_the_magic_gets_no_proof() -> None:
    b = _mesh(1)
    port = b.listen("127.0.0.1")
    task = asyncio.ensure_future(b.connect([1, port], deadline_s=1.0))
    wrong_rank = direct_mesh._HELLO.pack(direct_mesh.MAGIC, 0, 7, b"x" * 16)
    no_magic = direct_mesh._HELLO.pack(b"GET / HT", 0, 1, b"x" * 16)
    assert await _stranger(port, wrong_rank) == b""
    assert await _stranger(port, no_magic) == b""
    assert await task is False  # rank 0 never came: no mesh
    b.close()


def test_ranks_that_cannot_reach_each_others_mesh_port_go_on_over_grpc(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Rank 1 advertises a port nobody listens on (a firewall that lets only
    # the gRPC ports through): every rank must agree to go without the mesh.
    listen = TcpMesh.listen

    def blocked(self: TcpMesh, bind_host: str) -> int:
        port = listen(self, bind_host)
        if self.me.rank == 1:
            self._close_listener()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return int(s.getsockname()[1])
        return port

    monkeypatch.setattr(TcpMesh, "listen", blocked)
    monkeypatch.setattr(direct_mesh, "FORM_S", 0.5)
    caplog.set_level(logging.WARNING, logger="ferrogrpc")
    group = backends(3, shm=False)
    try:
        assert all(b.peer._engine.direct is None for b in group)
        assert any("TCP mesh" in r.getMessage() for r in caplog.records)

        def work(rank: int) -> None:
            xs = [torch.full((5,), float(r + 1), dtype=torch.float64) for r in range(3)]
            t = xs[rank].clone()
            group[rank].all_reduce(t)
            torch.testing.assert_close(t, torch.stack(xs).sum(0), rtol=0, atol=0)

        on_ranks(work, 3)
    finally:
        for b in group:
            b.close()


def test_a_message_corrupted_on_the_mesh_is_a_protocol_error_naming_the_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = backends(2, shm=False)
    try:
        meshes = [b.peer._mesh for b in group]
        assert all(m is not None for m in meshes), "one rank per host: the mesh must form"
        sender = group[1].peer._engine.direct
        assert sender is not None
        real = sender._checksum
        assert real is not None, "the default checksum must guard the mesh's messages"
        # Rank 1's checksum of what it sends is off by one: as if the bytes
        # had changed on the way.
        sender._checksum = lambda data: (real(data) + 1) & 0xFFFFFFFF

        def work(rank: int) -> Any:
            try:
                group[rank].all_reduce(torch.ones(4))
            except fg.FerroGrpcError as exc:
                return exc
            return None

        errors = on_ranks(work, 2)
        assert isinstance(errors[0], fg.ProtocolError), errors
        assert errors[0].peer == 1 and "checksum" in str(errors[0]), errors
        assert isinstance(errors[1], fg.FerroGrpcError), errors
    finally:
        for b in group:
            b.close()


def _fake_listener() -> tuple[int, list[bytes], threading.Thread, socket.socket]:
    """A listener that answers a connector's hello with a random MAC (it holds
    no rank's credential), then says it formed the whole mesh. Returns its
    port, what each connector sent after the wrong MAC, its thread and its
    socket (closed by the caller)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(10)
    after: list[bytes] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5)
                hello = b""
                while len(hello) < direct_mesh._HELLO.size:
                    got = conn.recv(direct_mesh._HELLO.size - len(hello))
                    if not got:
                        return
                    hello += got
                conn.sendall(os.urandom(16 + 32))  # its nonce and a wrong proof
                rest = b""
                with contextlib.suppress(OSError):
                    while got := conn.recv(64):
                        rest += got
                        if len(rest) >= 32:
                            conn.sendall(b"\x01")  # "I formed it": agree to use it
                            break
                after.append(rest)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return int(server.getsockname()[1]), after, thread, server


def test_a_listener_that_fails_its_proof_is_refused_and_the_ranks_go_on_over_grpc(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 56 item 13. Rank 1 advertises the port of an impostor that
    # answers rank 0's hello with a MAC no credential made: rank 0 must hang
    # up on it (sending no proof of its own), and both ranks go on over gRPC.
    port, after, thread, server = _fake_listener()
    listen = TcpMesh.listen

    def impostor(self: TcpMesh, bind_host: str) -> int:
        real = listen(self, bind_host)
        if self.me.rank == 1:
            self._close_listener()
            return port
        return real

    monkeypatch.setattr(TcpMesh, "listen", impostor)
    monkeypatch.setattr(direct_mesh, "FORM_S", 0.5)
    caplog.set_level(logging.WARNING, logger="ferrogrpc")
    group = backends(2, shm=False)
    try:
        thread.join(10)
        assert after == [b""], f"rank 0 answered a listener that failed its proof: {after}"
        assert [b.peer._engine.direct for b in group] == [None, None]
        assert any("TCP mesh" in r.getMessage() for r in caplog.records)

        def work(rank: int) -> None:
            t = torch.full((5,), float(rank + 1), dtype=torch.float64)
            group[rank].all_reduce(t)
            torch.testing.assert_close(t, torch.full((5,), 3.0, dtype=torch.float64))

        on_ranks(work, 2)
    finally:
        server.close()
        for b in group:
            b.close()


def test_one_rank_short_of_its_mesh_means_no_rank_uses_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 56 item 14. Rank 0 reaches ranks 1 and 2; rank 1 never reaches
    # rank 2 (a firewall that drops its packets), so ranks 1 and 2 lack a
    # connection. Rank 0 formed all of its own and must still go without.
    dial = TcpMesh._dial

    async def firewalled(self: TcpMesh, rank: int, host: str, port: int) -> None:
        if (self.me.rank, rank) == (1, 2):
            await asyncio.sleep(3600)
        await dial(self, rank, host, port)

    formed: dict[int, bool] = {}
    agree = TcpMesh._agree

    async def spy(self: TcpMesh, mine: bool, deadline_s: float) -> bool:
        formed[self.me.rank] = mine
        return await agree(self, mine, deadline_s)

    monkeypatch.setattr(TcpMesh, "_dial", firewalled)
    monkeypatch.setattr(TcpMesh, "_agree", spy)
    monkeypatch.setattr(direct_mesh, "FORM_S", 1.0)
    caplog.set_level(logging.WARNING, logger="ferrogrpc")
    group = backends(3, shm=False)
    try:
        assert formed == {0: True, 1: False, 2: False}, formed
        assert [b.peer._engine.direct for b in group] == [None, None, None]
        assert any("TCP mesh" in r.getMessage() for r in caplog.records)

        def work(rank: int) -> None:
            xs = [torch.full((3,), float(r + 1), dtype=torch.float64) for r in range(3)]
            t = xs[rank].clone()
            group[rank].all_reduce(t)
            torch.testing.assert_close(t, torch.stack(xs).sum(0), rtol=0, atol=0)

        on_ranks(work, 3)
    finally:
        for b in group:
            b.close()
