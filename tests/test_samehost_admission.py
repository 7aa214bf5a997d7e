"""Who may connect to a rank's same-host socket (see [Note: same-host
admission] in ferrogrpc/samehost/plane.py): its name carries no secret,
another user is refused before anything it sends is read, and a
connection that sends nothing never delays the real ranks."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import struct
import time
from pathlib import Path

import pytest

import ferrogrpc as fg
from ferrogrpc.errors import Identity
from ferrogrpc.runtime.intake import credential
from ferrogrpc.samehost.plane import _FRAME, HELLO, LocalPlane, _socket_name
from ferrogrpc.v1 import collective_pb2 as pb

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534


def _report(abort: pb.Abort) -> fg.FerroGrpcError:
    return fg.PeerError(abort.message)


async def test_no_secret_appears_in_the_socket_names() -> None:
    # Any user of the network namespace reads every name in /proc/net/unix.
    for token in (None, "a-token"):
        async with fg.testing.local_group(2, transport="shm", token=token) as peers:
            table = Path("/proc/net/unix").read_text()  # noqa: ASYNC240 - procfs, instant
            parts = peers[0]._parts
            assert parts.result.nonces and parts.credentials
            for secret in [*parts.result.nonces, *parts.credentials]:
                assert secret not in table, (secret, "found in /proc/net/unix")
            assert "@ferrogrpc." in table  # the sockets are there, named


def _as_another_user(name: bytes, payload: bytes, size: int) -> str:
    """In a child forked as another user: connect to the socket ``name`` and
    send a rank's hello (``payload``, a segment of ``size`` bytes and a
    direct socket), as rank 0's is; say whether anything was answered."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only socket calls, then _exit
        verdict = "error"
        try:
            os.setuid(NOBODY)
            frame = _FRAME.pack(len(payload), HELLO, 0) + payload
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(name)
                fd = os.memfd_create("rogue")
                os.ftruncate(fd, size)
                _mine, theirs = socket.socketpair()
                try:
                    socket.send_fds(sock, [frame], [fd, theirs.fileno()])
                    data, fds, _, _ = socket.recv_fds(sock, 1024, 1)
                    verdict = f"answered {len(data)} {len(fds)}" if data or fds else "refused"
                except OSError as exc:
                    verdict = f"refused ({exc})"
        except BaseException as exc:
            verdict = f"error {exc!r}"
        os.write(write, verdict.encode())
        os._exit(0)
    os.close(write)
    try:
        chunks = []
        while chunk := os.read(read, 1024):
            chunks.append(chunk)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return b"".join(chunks).decode()


async def test_another_user_is_refused_even_with_the_credential() -> None:
    if os.getuid() != 0:
        pytest.fail("this test runs as root, to start a process as another user")
    nonces = [secrets.token_hex(16) for _ in range(2)]
    planes = [LocalPlane(n) for n in nonces]
    try:
        accepting = asyncio.ensure_future(
            planes[1].connect(Identity(1, 2), [0, 1], nonces, 20, _report)
        )
        # Rank 0's hello, with the right credential: the worst case, as if
        # the nonce had leaked some other way.
        payload = struct.pack("<I", 0) + nonces[0].encode()
        size = planes[1].slots * planes[1].slot_bytes
        name = _socket_name(nonces[1])
        loop = asyncio.get_running_loop()
        verdict = await loop.run_in_executor(None, _as_another_user, name, payload, size)
        assert verdict.startswith("refused"), verdict
        # The real rank 0 is still taken, and maps the real segment.
        await planes[0].connect(Identity(0, 2), [0, 1], nonces, 20, _report)
        await asyncio.wait_for(accepting, 20)
        planes[0].slot(0, 0)[:4] = 7
        assert planes[1].slot(0, 0)[:4].tolist() == [7, 7, 7, 7]
    finally:
        for plane in planes:
            await plane.close()


@pytest.mark.parametrize("token", [None, "a-token"], ids=["no token", "token"])
async def test_a_connection_that_sends_nothing_does_not_delay_the_ranks(
    token: str | None,
) -> None:
    nonces = [secrets.token_hex(16) for _ in range(3)]
    proofs = [credential(token, n) for n in nonces]
    planes = [LocalPlane(n) for n in nonces]
    silent: list[socket.socket] = []
    timeout = 20.0
    try:
        # A local process of the job's own user connects to every rank's
        # socket first, and then says nothing.
        for nonce in nonces:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(_socket_name(nonce))
            silent.append(sock)
        start = time.monotonic()
        await asyncio.gather(
            *(
                plane.connect(
                    Identity(rank, 3),
                    [0, 1, 2],
                    nonces,
                    timeout,
                    _report,
                    proofs=proofs,
                    proof=proofs[rank],
                )
                for rank, plane in enumerate(planes)
            )
        )
        took = time.monotonic() - start
        assert took < 3.0, f"the ranks connected in {took:.1f}s (connect timeout {timeout:g}s)"
        assert all(set(p.links) == {0, 1, 2} - {r} for r, p in enumerate(planes))
    finally:
        for sock in silent:
            sock.close()
        for plane in planes:
            await plane.close()
