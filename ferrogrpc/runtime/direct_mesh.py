"""The TCP mesh: direct sockets between hosts (algorithms/direct.py).

Where no two ranks of a group share memory (one rank per host, or shared
memory turned off), a small collective over gRPC is handed from the
caller's thread to the event loop, from the loop to gRPC's poller thread
and back for every message, and from the loop back to the caller: half a
dozen thread wake-ups per call, each one a wait for a CPU when the host
is busy, and about 400 us of the loop's CPU. The mesh gives every pair of
ranks one TCP connection that the calling thread uses itself, as on one
host (direct.py): no hand-off at all for a synchronous call.

[Note: the TCP mesh]
Set-up, in :meth:`Peer.start` after the ring check, the same on every rank:

1. each rank listens on its gRPC bind host, port 0;
2. the ports go round in the all-gather over gRPC that checks the ring
   (authenticated there; it takes the place of the ring check's barrier);
3. each rank connects to every higher rank and admits every lower one.
   A connection is admitted by a handshake bound to both ranks'
   credentials (intake.credential)::

     connector -> listener: MAGIC, its rank, the listener's rank, 16 random bytes
     listener -> connector: 16 random bytes, HMAC(listener's credential, proof)
     connector -> listener: HMAC(connector's credential, proof)

   where each proof covers both random strings, both ranks and the role,
   so no proof can be replayed. Each handshake runs on its own with a
   :data:`HANDSHAKE_S` deadline: a connection that sends nothing, or
   fails it, is dropped and delays nobody. The listener closes once every
   lower rank is connected;
4. each rank tells every peer it reached whether it reached them all, and
   uses the mesh only if it did and they all did: a rank that reached all
   hears from all, so every rank decides alike. If any could not (a
   firewall that opens only the gRPC ports), no rank uses the mesh: small
   collectives go over gRPC as before, and a warning says why.

The mesh is not used with TLS (its bytes are not encrypted; gRPC's are),
nor with ``FERROGRPC_DIRECT=0``. Its messages carry the job's checksum,
as gRPC chunks do. A peer that another rank ran over gRPC (a size on the
other side of the threshold) is seen by the intake's arrival hook
(Mailboxes.on_arrival) and named as a mismatch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
from collections.abc import Sequence

from ..algorithms.context import RankContext
from ..errors import FerroGrpcError
from ..transport.integrity import Checksum
from ..v1 import collective_pb2 as pb

log = logging.getLogger(__name__)

MAGIC = b"FGMESH1\0"
_HELLO = struct.Struct("<8sII16s")
_NONCE = 16
_MAC = 32
# How long one connection's handshake may take.
HANDSHAKE_S = 2.0
# How long the whole mesh may take to form before the group goes without it.
FORM_S = 5.0
# The socket buffers asked for (the kernel caps them).
SOCKET_BYTES = 1 << 20
# Arrivals over gRPC remembered for the mismatch check (Mailboxes.on_arrival).
ARRIVALS_KEPT = 1024


def _proof(credential: str, role: bytes, lo: int, hi: int, c: bytes, listener: bytes) -> bytes:
    msg = role + struct.pack("<II", lo, hi) + c + listener
    return hmac.new(credential.encode(), msg, hashlib.sha256).digest()


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


class TcpMesh:
    """One rank's TCP connections to every other rank; a
    :class:`~ferrogrpc.algorithms.direct.DirectSockets` (see the module
    docstring)."""

    where = ""

    def __init__(self, ctx: RankContext, credentials: Sequence[str]) -> None:
        self.ctx = ctx
        self.me = ctx.identity
        self.credentials = list(credentials)
        self.checksum: Checksum | None = ctx.checksum
        self.socks: dict[int, socket.socket] = {}
        self.direct_seq = 0
        self.wake_r, self._wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # (seq, src) -> the descriptor a rank streamed over gRPC.
        self._arrived: collections.OrderedDict[tuple[int, int], pb.Descriptor] = (
            collections.OrderedDict()
        )
        self._listener: socket.socket | None = None

    # ------------------------------------------------------------ set-up

    def listen(self, bind_host: str) -> int:
        """Listen on ``bind_host``; return the port."""
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, 0))
        sock.listen(max(8, self.me.world_size))
        sock.setblocking(False)
        self._listener = sock
        return int(sock.getsockname()[1])

    async def connect(self, ports: Sequence[int], deadline_s: float | None = None) -> bool:
        """Connect to every higher rank, admit every lower one; True if every
        rank formed every connection within ``deadline_s`` (default
        :data:`FORM_S`). Closes the listener."""
        if deadline_s is None:
            deadline_s = FORM_S
        me, world = self.me.rank, self.me.world_size
        lower = set(range(me))
        try:
            async with asyncio.timeout(deadline_s), asyncio.TaskGroup() as group:
                group.create_task(self._admit(lower))
                for r in range(me + 1, world):
                    group.create_task(self._dial(r, _host(self.me.address_of(r)), ports[r]))
        except (TimeoutError, OSError, ExceptionGroup) as exc:
            log.debug("rank %d: the TCP mesh did not form: %r", me, exc)
        finally:
            self._close_listener()
        return await self._agree(len(self.socks) == world - 1, deadline_s)

    async def _agree(self, mine: bool, deadline_s: float) -> bool:
        """Whether every rank formed the whole mesh: each tells the peers it
        reached whether it did, and uses the mesh only if it did and every
        peer says so. A rank that formed it hears from every rank, so all
        decide alike without a collective more."""
        loop = asyncio.get_running_loop()
        socks = list(self.socks.values())
        try:
            async with asyncio.timeout(deadline_s + HANDSHAKE_S):
                for sock in socks:
                    await loop.sock_sendall(sock, b"\x01" if mine else b"\x00")
                theirs = [await _read(loop, sock, 1) for sock in socks]
        except (TimeoutError, OSError) as exc:
            log.debug("rank %d: no word from every mesh peer: %r", self.me.rank, exc)
            return False
        return mine and all(flag == b"\x01" for flag in theirs)

    async def _dial(self, rank: int, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
            c = os.urandom(_NONCE)
            me = self.me.rank
            await loop.sock_sendall(sock, _HELLO.pack(MAGIC, me, rank, c))
            reply = await _read(loop, sock, _NONCE + _MAC)
            theirs, mac = reply[:_NONCE], reply[_NONCE:]
            want = _proof(self.credentials[rank], b"listener", me, rank, c, theirs)
            if not hmac.compare_digest(mac, want):
                raise ConnectionError(f"rank {rank}'s mesh listener failed its proof")
            await loop.sock_sendall(
                sock, _proof(self.credentials[me], b"connector", me, rank, c, theirs)
            )
        except BaseException:
            sock.close()
            raise
        self._keep(rank, sock)

    async def _admit(self, lower: set[int]) -> None:
        """Accept until every rank in ``lower`` is connected; each handshake
        on its own (a stranger delays nobody)."""
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        pending: set[asyncio.Task[None]] = set()
        waiting = set(lower)
        try:
            while waiting - set(self.socks):
                accept = asyncio.ensure_future(loop.sock_accept(self._listener))
                while not accept.done():
                    done, _ = await asyncio.wait(
                        {accept, *pending}, return_when=asyncio.FIRST_COMPLETED
                    )
                    for task in done - {accept}:
                        pending.discard(task)
                    if not waiting - set(self.socks):
                        accept.cancel()
                        return
                if accept.cancelled():
                    return
                sock, _ = accept.result()
                sock.setblocking(False)
                pending.add(asyncio.ensure_future(self._hello(sock, waiting)))
        finally:
            for task in pending:
                task.cancel()

    async def _hello(self, sock: socket.socket, waiting: set[int]) -> None:
        loop = asyncio.get_running_loop()
        me = self.me.rank
        admitted = False
        try:
            async with asyncio.timeout(HANDSHAKE_S):
                magic, src, dst, c = _HELLO.unpack(await _read(loop, sock, _HELLO.size))
                if magic != MAGIC or dst != me or src not in waiting or src in self.socks:
                    raise ConnectionError("not a rank of this group's mesh")
                mine = os.urandom(_NONCE)
                await loop.sock_sendall(
                    sock, mine + _proof(self.credentials[me], b"listener", src, me, c, mine)
                )
                mac = await _read(loop, sock, _MAC)
                want = _proof(self.credentials[src], b"connector", src, me, c, mine)
                if not hmac.compare_digest(mac, want) or src in self.socks:
                    raise ConnectionError(f"a connection claiming rank {src} failed its proof")
            admitted = True
        except (TimeoutError, OSError, struct.error) as exc:
            log.debug("rank %d: refused a mesh connection: %r", me, exc)
        finally:
            if not admitted:
                sock.close()  # refused, or the mesh formed without it
        if admitted:
            self._keep(src, sock)

    def _keep(self, rank: int, sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BYTES)
        self.socks[rank] = sock

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def close(self) -> None:
        """Close every socket: a thread still waiting on one sees its end."""
        self._close_listener()
        for sock in self.socks.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.wake()
        self.wake_r.close()
        self._wake_w.close()

    # --------------------------------------- as direct.py's DirectSockets

    # A peer that fails sends its abort over gRPC before it closes these
    # sockets (Peer._shutdown drains aborts first): a short wait lets it land.
    report_wait = 0.1
    between_hosts = True  # a vanished host closes no socket: waits probe

    def direct_sockets(self) -> dict[int, socket.socket]:
        return dict(self.socks)

    @property
    def failed(self) -> FerroGrpcError | None:
        return None  # a report over gRPC breaks the group (check_open sees it)

    def gone_of(self, rank: int) -> FerroGrpcError | None:
        return None  # the socket's end says it (direct.py)

    def other_way(self, rank: int, seq: int) -> tuple[pb.Descriptor, str] | None:
        theirs = self._arrived.get((seq, rank))
        if theirs is None:
            return None
        return theirs, "ran it over gRPC, as a larger collective"

    def note_arrival(self, seq: int, src: int, header: pb.ChunkHeader) -> None:
        """Mailboxes.on_arrival (on the loop): what came over gRPC for a
        collective; it wakes a direct wait for that collective."""
        self._arrived[(seq, src)] = header.descriptor
        while len(self._arrived) > ARRIVALS_KEPT:
            self._arrived.popitem(last=False)
        if seq == self.direct_seq:
            self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending) or closed
            self._wake_w.send(b"w")

    def abort(self, abort: pb.Abort) -> None:
        """Nothing: the failure policy's abort over gRPC reaches every rank."""


async def _read(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = await loop.sock_recv(sock, n - len(buf))
        if not got:
            raise ConnectionError("the connection ended")
        buf += got
    return bytes(buf)
