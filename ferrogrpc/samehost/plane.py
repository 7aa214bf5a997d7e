"""The same-host plane: shared memory between the ranks of one host.

Each rank owns one shared segment (a ``memfd``: anonymous memory with no
name in any file system, so nothing can outlive the processes that map it,
SIGKILL included) and listens on an abstract Unix socket (a name in the
network namespace, not a file). After the rendezvous, the ranks of a host
connect pairwise, prove who they are with their session credential, and
pass each other their segment's file descriptor (SCM_RIGHTS); each maps the
others' segments read-only.

[Note: same-host admission] Every user of the network namespace can read
the socket's name (``/proc/net/unix``), so the name carries no secret: it
is a one-way hash of the rank's nonce. Both ends of every connection check
the other's uid (``SO_PEERCRED``) before a byte is read: a process of
another user is dropped at once. A process of the job's own user must
still present the claimed rank's credential in its hello. Each hello is
read on its own short deadline (``HELLO_S``), concurrently with the
others: a connection that sends nothing never delays the real ranks.

The connections then carry small signals, in order: a collective's
descriptor when a rank begins it, and per round "my slot is written",
"my part is reduced", "I am done with your slots". The kernel orders a
socket write after the writer's stores to shared memory, so a signal read is
a promise that the data is there. A connection that ends without an abort
means its process is gone or closed: every wait for it fails at once. Each
pair also shares a direct socket pair, for small collectives (direct.py).

Two ranks share a host only when they share memory *and* a network
namespace: their host keys (boot id and network namespace inode) are equal.
Containers and ``ip netns`` hosts are therefore different hosts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import mmap
import os
import select
import socket
import struct
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from ..counter import Counter
from ..errors import (
    ConfigError,
    Evidence,
    FerroGrpcError,
    Identity,
    PeerError,
    ProtocolError,
    RendezvousError,
)
from ..transport.integrity import Checksum
from ..v1 import collective_pb2 as pb
from .segment import Segment, Spare, unmap

# Signal kinds.
BEGIN = 1  # payload: the serialized Descriptor of the collective (arg: seq)
WRITTEN = 2  # arg: global round number
REDUCED = 3
DONE = 4
ABORT = 5  # payload: a serialized pb.Abort
HELLO = 6  # payload: the sender's rank and nonce
# A small collective's whole message (arg: seq): the serialized Descriptor's
# length (2 bytes), the Descriptor, then the data.
SMALL = 7

_DESC_LEN = struct.Struct("<H")

# Collectives whose messages a plane drops (see LocalPlane.forget): the last
# this many.
FORGOTTEN_KEPT = 1024

_FRAME = struct.Struct("<IBQ")  # payload length, kind, arg

# A rank's segment: SLOTS slots of SLOT_BYTES, used round-robin by rounds.
# Interleaved A/B on the 2-core reference machine (64 MiB all_reduce, world
# 2 and 4): 16 MiB x 2 ran 10-25% faster than 4 MiB x 4 (fewer rounds, so
# fewer signals and Python per byte), as fast as 16 x 4 or 32 x 2.
SLOT_BYTES = 16 << 20
SLOTS = 2


def segment_bytes() -> int:
    """The size of a rank's segment (read when needed: tests shrink it)."""
    return SLOTS * SLOT_BYTES


DIRECT_SNDBUF = 1 << 20  # asked for on a direct socket (the kernel caps it)

# How long an accepted connection has to present its hello (see [Note:
# same-host admission]); a real rank sends it at once.
HELLO_S = 2.0

_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid

# How long close() waits for signals still being written to be delivered.
CLOSE_FLUSH_S = 2.0


def host_key(enabled: bool) -> str:
    """This process's host identity: the kernel's boot id and the network
    namespace's inode. Empty (a host of its own) when the same-host plane is
    off or the identity cannot be read."""
    if not enabled:
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}:{netns}"


def _socket_name(nonce: str) -> bytes:
    """The abstract socket name of the rank that published ``nonce``: a
    one-way hash of it, since anyone can read the name (see [Note: same-host
    admission])."""
    digest = hashlib.sha256(b"ferrogrpc same-host listener:" + nonce.encode()).hexdigest()
    return b"\0ferrogrpc." + digest[:32].encode()


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(creds)[1])


def _same_user(sock: socket.socket) -> bool:
    try:
        return peer_uid(sock) == os.getuid()
    except OSError:
        return False


class _RefusedError(OSError):
    """Rank ``rank``'s socket refused the connection (its process is gone)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank}'s socket refused the connection")
        self.rank = rank


class _Link:
    """The connection to one local peer, and what it has signalled."""

    def __init__(self, rank: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.rank = rank
        self.reader = reader
        self.writer = writer
        self.written = Counter()
        self.reduced = Counter()
        self.done = Counter()
        # The first message of each collective from this peer: (kind, payload),
        # BEGIN for a collective through the segments, SMALL for a small one.
        self.first: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.segment: torch.Tensor | None = None
        self.task: asyncio.Task[None] | None = None
        self.direct: socket.socket | None = None  # for direct.py
        # Why its connection ended without an abort (gone, or closed).
        self.gone: FerroGrpcError | None = None


class LocalPlane:
    """This rank's end of its host's shared memory and signal mesh."""

    def __init__(self, nonce: str, spare: Spare | None = None) -> None:
        """``spare``: where a segment made ahead may be ready (see [Note: a
        segment made ahead] in segment.py)."""
        self.nonce = nonce
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(_socket_name(nonce))
        self.listener.listen(64)
        # Read at creation: every rank of a job uses the same module constant.
        self.slot_bytes = SLOT_BYTES
        self.slots = SLOTS
        nbytes = self.slots * self.slot_bytes
        took = spare.take(nbytes) if spare is not None else None
        self._mine: Segment | None = took or Segment(nbytes)
        self._spare = spare
        self.fd = self._mine.fd
        self.segment = self._mine.tensor
        self.links: dict[int, _Link] = {}
        self.me: Identity | None = None
        self.round = 0  # the global round counter: the same on every local rank
        self._failed: FerroGrpcError | None = None
        self._report: Callable[[pb.Abort], FerroGrpcError] | None = None
        self._maps: list[mmap.mmap] = []  # the local peers' segments
        self._proof = nonce  # what this rank's hello presents (see connect())
        # Sequence numbers of collectives no rank will run here (forget()).
        self._forgotten: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Wakes a thread waiting on the direct sockets (wake()), as does a first
        # message through the signals for the collective it waits in.
        self.wake_r, self._wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.direct_seq = 0

    # ------------------------------------------------------------ set-up

    async def connect(
        self,
        me: Identity,
        local: Sequence[int],
        nonces: Sequence[str],
        timeout: float,
        report: Callable[[pb.Abort], FerroGrpcError],
        *,
        proofs: Sequence[str] | None = None,
        proof: str | None = None,
    ) -> None:
        """Connect to every other rank in ``local`` (this host's ranks), swap
        segments, and start listening for their signals. ``nonces`` name the
        ranks' sockets; a rank proves who it is with ``proofs[rank]`` (this
        rank with ``proof``; both default to the nonces; see
        intake.credential). ``report`` turns a peer's abort message into the
        error to raise."""
        self.me = me
        self._report = report
        self._proof = proof if proof is not None else self.nonce
        proofs = list(proofs) if proofs is not None else list(nonces)
        peers = [r for r in local if r != me.rank]
        if not peers:
            return
        loop = asyncio.get_running_loop()
        try:
            socks = await asyncio.wait_for(
                loop.run_in_executor(None, self._mesh, me.rank, peers, nonces, proofs, timeout),
                timeout,
            )
        except (OSError, TimeoutError) as exc:
            # A rank whose socket refused is gone (its plane closed with its
            # process): named, so that an elastic group goes on without it.
            refused = exc.rank if isinstance(exc, _RefusedError) else None
            raise RendezvousError(
                f"could not connect to the ranks on this host ({peers}) through shared memory: "
                + (
                    f"rank {refused} refused ({exc.__cause__!r})"
                    if refused is not None
                    else repr(exc)
                )
                + "; set FERROGRPC_SHM=0 to use gRPC between them",
                rank=me.rank,
                world_size=me.world_size,
                peer=refused,
                evidence=Evidence.UNREACHABLE if refused is not None else Evidence.FOUND,
            ) from exc
        items = list(socks.items())
        for i, (rank, (sock, fd, direct)) in enumerate(items):
            try:
                mapped = mmap.mmap(fd, self.slots * self.slot_bytes, prot=mmap.PROT_READ)
            except (OSError, ValueError) as exc:  # not a segment of the expected size
                for _, (other, other_fd, other_direct) in items[i + 1 :]:
                    os.close(other_fd)
                    other.close()
                    other_direct.close()
                sock.close()
                direct.close()
                raise RendezvousError(
                    f"rank {rank} on this host passed a segment that cannot be mapped: {exc}",
                    rank=me.rank,
                    world_size=me.world_size,
                ) from exc
            finally:
                os.close(fd)
            self._maps.append(mapped)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            link = _Link(rank, reader, writer)
            link.segment = _readonly_tensor(mapped)
            link.direct = direct
            self.links[rank] = link
        for link in self.links.values():
            link.task = asyncio.ensure_future(self._listen(link))
        # Every local peer is connected: nobody else may connect any more.
        self.listener.close()

    def _mesh(
        self,
        rank: int,
        peers: list[int],
        nonces: Sequence[str],
        proofs: Sequence[str],
        timeout: float,
    ) -> dict[int, tuple[socket.socket, int, socket.socket]]:
        """Blocking: connect to higher-ranked peers, then accept the lower
        ones. The highest rank only accepts, so every wait ends. Each pair
        also gets a direct socket: the connecting rank's hello passes one
        end of a new socket pair. See [Note: same-host admission]."""
        out: dict[int, tuple[socket.socket, int, socket.socket]] = {}
        try:
            for peer in (p for p in peers if p > rank):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    try:
                        sock.connect(_socket_name(nonces[peer]))
                    except (ConnectionRefusedError, FileNotFoundError) as exc:
                        raise _RefusedError(peer) from exc
                    if not _same_user(sock):
                        raise OSError(f"rank {peer}'s socket is held by another user")
                    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        self._hello(sock, rank, theirs)
                    finally:
                        theirs.close()
                    got, fd, _ = self._expect_hello(sock, proofs, 1)
                except BaseException:
                    sock.close()
                    raise
                if got != peer:
                    os.close(fd)
                    mine.close()
                    sock.close()
                    raise OSError(f"rank {peer}'s socket answered as rank {got}")
                out[peer] = (sock, fd, mine)
            self._accept_lower(rank, {p for p in peers if p < rank}, proofs, timeout, out)
        except BaseException:
            for sock, fd, direct in out.values():
                os.close(fd)
                direct.close()
                sock.close()
            raise
        for sock, _, direct in out.values():
            sock.setblocking(False)
            direct.settimeout(None)
            with contextlib.suppress(OSError):  # the kernel caps it; best effort
                direct.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, DIRECT_SNDBUF)
        return out

    def _accept_lower(
        self,
        rank: int,
        lower: set[int],
        proofs: Sequence[str],
        timeout: float,
        out: dict[int, tuple[socket.socket, int, socket.socket]],
    ) -> None:
        """Accept the lower-ranked peers into ``out``. Every connection gets
        HELLO_S to present its hello, all at once: one that sends nothing
        (or too late, or as another user, or without the credential) is
        dropped without delaying the others."""
        end = time.monotonic() + timeout
        waiting: dict[socket.socket, float] = {}  # accepted, hello not yet read
        self.listener.setblocking(False)
        try:
            while lower:
                now = time.monotonic()
                for sock in [s for s, by in waiting.items() if by <= now]:
                    del waiting[sock]
                    sock.close()  # a stranger that said nothing in time
                if now >= end:
                    raise TimeoutError(f"ranks {sorted(lower)} of this host did not connect")
                wait = min([end, *waiting.values()]) - now
                readable, _, _ = select.select([self.listener, *waiting], [], [], wait)
                for ready in readable:
                    if ready is self.listener:
                        with contextlib.suppress(BlockingIOError, InterruptedError):
                            sock, _ = self.listener.accept()
                            if _same_user(sock):
                                waiting[sock] = time.monotonic() + min(HELLO_S, timeout)
                            else:
                                sock.close()  # another user: refused before a byte
                        continue
                    del waiting[ready]
                    ready.settimeout(max(0.001, min(HELLO_S, end - time.monotonic())))
                    try:
                        got, fd, direct = self._expect_hello(ready, proofs, 2)
                    except OSError:
                        ready.close()  # a stranger: not a rank of this group
                        continue
                    assert direct is not None
                    if got not in lower:
                        os.close(fd)
                        direct.close()
                        ready.close()
                        continue
                    ready.settimeout(timeout)
                    self._hello(ready, rank)
                    lower.discard(got)
                    out[got] = (ready, fd, direct)
        finally:
            for sock in waiting:
                sock.close()

    def _hello(self, sock: socket.socket, rank: int, direct: socket.socket | None = None) -> None:
        payload = struct.pack("<I", rank) + self._proof.encode()
        fds = [self.fd] if direct is None else [self.fd, direct.fileno()]
        socket.send_fds(sock, [_FRAME.pack(len(payload), HELLO, 0) + payload], fds)

    def _expect_hello(
        self, sock: socket.socket, proofs: Sequence[str], nfds: int
    ) -> tuple[int, int, socket.socket | None]:
        """The hello on ``sock``: the sender's rank, its segment's fd, and
        (with ``nfds`` 2) the direct socket it passed."""
        data, fds, _, _ = socket.recv_fds(sock, _FRAME.size + 4 + 64, nfds)
        if len(data) < _FRAME.size + 4 or len(fds) != nfds:
            for fd in fds:
                os.close(fd)
            raise OSError("malformed hello")
        length, kind, _ = _FRAME.unpack_from(data)
        rank = struct.unpack_from("<I", data, _FRAME.size)[0]
        presented = data[_FRAME.size + 4 : _FRAME.size + length]
        expected = proofs[rank].encode() if rank < len(proofs) else b""
        if kind != HELLO or not expected or not hmac.compare_digest(presented, expected):
            for fd in fds:
                os.close(fd)
            raise OSError(f"hello claiming rank {rank} without its credential")
        direct = socket.socket(fileno=fds[1]) if nfds == 2 else None
        return rank, fds[0], direct

    # ------------------------------------------------------------ signals

    async def _listen(self, link: _Link) -> None:
        reader = link.reader
        try:
            while True:
                head = await reader.readexactly(_FRAME.size)
                length, kind, arg = _FRAME.unpack(head)
                payload = await reader.readexactly(length) if length else b""
                if kind == WRITTEN:
                    link.written.advance_to(arg + 1)
                elif kind == REDUCED:
                    link.reduced.advance_to(arg + 1)
                elif kind == DONE:
                    link.done.advance_to(arg + 1)
                elif kind in (BEGIN, SMALL):
                    if arg in self._forgotten:
                        continue
                    fut = self._first(link, arg)
                    if fut.done():
                        # Not a vanished process: say what it is.
                        self._fail(
                            ProtocolError(
                                f"rank {link.rank} began collective #{arg} twice on the "
                                "same-host plane",
                                peer=link.rank,
                                evidence=Evidence.FOUND,
                            )
                        )
                        return
                    fut.set_result((kind, payload))
                    if arg == self.direct_seq:
                        self.wake()  # a direct wait for it learns it ran another way
                elif kind == ABORT:
                    # Read on: a report of a symptom may be followed by the
                    # cause (see _fail).
                    assert self._report is not None
                    self._fail(self._report(pb.Abort.FromString(payload)))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            # Only waits for this rank fail: one that finished and closed has
            # sent all it had to, and others may still be finishing. Built
            # without this rank's identity: whoever waits stamps it.
            link.gone = PeerError(
                f"rank {link.rank} on this host is gone: its shared-memory connection closed",
                peer=link.rank,
                evidence=Evidence.UNREACHABLE,
            )
            _fail_waits(link, link.gone)
            self.wake()
        except asyncio.CancelledError:
            raise

    def _first(self, link: _Link, seq: int) -> asyncio.Future[tuple[int, bytes]]:
        fut = link.first.get(seq)
        if fut is None:
            fut = link.first[seq] = asyncio.get_running_loop().create_future()
            failed = self._failed or link.gone
            if failed is not None:
                fut.set_exception(failed)
                fut.exception()
        return fut

    def _fail(self, err: FerroGrpcError) -> None:
        """The plane is unusable: every wait on it raises ``err``. A later
        account replaces a symptom (a report that only saw a stream end):
        the waits failed already, but :attr:`failed` then names the cause."""
        if self._failed is not None:
            if self._failed.evidence is Evidence.SYMPTOM and err.evidence is not Evidence.SYMPTOM:
                self._failed = err
            return
        self._failed = err
        self.wake()
        for link in self.links.values():
            _fail_waits(link, err)

    def forget(self, seq: int) -> None:
        """Collective ``seq`` will not run on this rank (some rank refused
        it): drop what local peers sent for it, now and later."""
        self._forgotten[seq] = None
        while len(self._forgotten) > FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)
        for link in self.links.values():
            link.first.pop(seq, None)

    @property
    def failed(self) -> FerroGrpcError | None:  # an abort, or a broken plane
        return self._failed

    # ------------------------------------------ as direct.py's DirectSockets

    where = "on this host"
    # How long a direct wait whose peer's socket ended waits for that peer's
    # report (its abort travels on the signal socket).
    report_wait = 1.0
    between_hosts = False  # a process that ends closes its sockets
    checksum: Checksum | None = None  # bytes that never leave the host's memory

    def direct_sockets(self) -> dict[int, socket.socket]:
        out = {}
        for rank, link in self.links.items():
            assert link.direct is not None
            out[rank] = link.direct
        return out

    def gone_of(self, rank: int) -> FerroGrpcError | None:
        return self.links[rank].gone

    def other_way(self, rank: int, seq: int) -> tuple[pb.Descriptor, str] | None:
        """What rank ``rank`` signalled for collective ``seq``, when it ran it
        through the segments or as a larger small collective (a direct
        collective signals nothing)."""
        fut = self.links[rank].first.get(seq)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        kind, payload = fut.result()
        if kind == BEGIN:
            return pb.Descriptor.FromString(payload), "ran it through shared segments"
        theirs = pb.Descriptor.FromString(split_small(payload)[0])
        return theirs, "ran it as a larger small collective"

    def wake(self) -> None:
        """Wake a thread waiting on the direct sockets (thread-safe)."""
        with contextlib.suppress(OSError):  # full (a wake is pending) or closed
            self._wake_w.send(b"w")

    def send(self, kind: int, arg: int, payload: bytes = b"") -> None:
        """Signal every local peer."""
        frame = _FRAME.pack(len(payload), kind, arg) + payload
        for link in self.links.values():
            if not link.writer.is_closing():
                link.writer.write(frame)

    def next_round(self) -> int:
        """The next global round number (every local rank counts alike)."""
        self.round += 1
        return self.round - 1

    def announce(self, seq: int, descriptor: bytes) -> None:
        """Tell every local peer this rank began collective ``seq``."""
        if self._failed is not None:
            raise self._failed
        self.send(BEGIN, seq, descriptor)

    async def first(self, rank: int, seq: int) -> tuple[int, bytes]:
        """``rank``'s first message of collective ``seq``: (BEGIN, its
        descriptor) or (SMALL, descriptor and data; see :func:`small_frame`)."""
        link = self.links[rank]
        fut = self._first(link, seq)
        try:
            return await asyncio.shield(fut)
        finally:
            if fut.done():
                link.first.pop(seq, None)

    def send_small(self, rank: int, seq: int, descriptor: bytes, data: memoryview) -> None:
        """One small collective's message to ``rank``."""
        link = self.links[rank]
        failed = self._failed or link.gone
        if failed is not None:
            raise failed
        head = _DESC_LEN.pack(len(descriptor)) + descriptor
        frame = _FRAME.pack(len(head) + data.nbytes, SMALL, seq) + head
        if not link.writer.is_closing():
            link.writer.writelines((frame, data))

    def abort(self, abort: pb.Abort) -> None:
        """Tell every local peer why this rank failed (best effort)."""
        self.send(ABORT, abort.seq, abort.SerializeToString())

    def slot(self, rank: int, index: int) -> torch.Tensor:
        """Slot ``index`` (bytes) of ``rank``'s segment: this rank's own is
        writable, the others' read-only."""
        seg = self.segment if self.me is None or rank == self.me.rank else self.links[rank].segment
        assert seg is not None
        lo = index * self.slot_bytes
        return seg[lo : lo + self.slot_bytes]

    async def close(self) -> None:
        # Signals already written are delivered before the sockets go: a
        # peer may still need this rank's last message (a small collective
        # completes here as soon as this rank has what it needs).
        for link in self.links.values():
            if not link.writer.is_closing():
                with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(link.writer.drain(), CLOSE_FLUSH_S)
            link.writer.close()
        for link in self.links.values():
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(link.writer.wait_closed(), CLOSE_FLUSH_S)
            if link.task is not None:
                link.task.cancel()
        tasks = [link.task for link in self.links.values() if link.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        directs = [link.direct for link in self.links.values() if link.direct is not None]
        for sock in directs:  # a thread still waiting on one sees its end; then it goes
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.links.clear()
        self.listener.close()
        self.wake_r.close()
        self._wake_w.close()
        self.segment = torch.empty(0, dtype=torch.uint8)
        maps, self._maps = self._maps, []
        mine, self._mine = self._mine, None
        self.fd = fd = -1
        if mine is None:
            return  # closed before
        # An elastic backend's next epoch may take this rank's own segment
        # (see [Note: a segment handed back] in segment.py).
        if self._spare is None or not self._spare.give(mine):
            maps.append(mine.map)
            fd = mine.fd
        # [Note: unmapping in the background] Unmapping the segments (this
        # rank's and every local peer's, 32 MiB each) is kernel work of 3-17
        # ms on a 2-core VM, and an elastic group's change of epoch waits for
        # its slowest member's close. A thread does it, mostly without the
        # interpreter's lock; the memory goes a few milliseconds after close().
        try:
            threading.Thread(
                target=unmap, args=(maps, fd), name="ferrogrpc-unmap", daemon=True
            ).start()
        except RuntimeError:  # no new threads: the interpreter is exiting
            unmap(maps, fd)


def _fail_waits(link: _Link, err: FerroGrpcError) -> None:
    for counter in (link.written, link.reduced, link.done):
        counter.fail(err)
    for fut in link.first.values():
        if not fut.done():
            fut.set_exception(err)
            fut.exception()


def split_small(payload: bytes) -> tuple[bytes, memoryview]:
    """A SMALL message's descriptor and data."""
    (n,) = _DESC_LEN.unpack_from(payload)
    view = memoryview(payload)
    return bytes(view[2 : 2 + n]), view[2 + n :]


def _readonly_tensor(mapped: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only memory: we only read it
        return torch.frombuffer(mapped, dtype=torch.uint8)


def check_enabled(enabled: object) -> bool:
    if not isinstance(enabled, bool):
        raise ConfigError(f"shm must be True or False, got {enabled!r}")
    return enabled
