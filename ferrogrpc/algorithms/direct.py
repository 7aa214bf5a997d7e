"""Small collectives run from the caller's thread, on direct sockets.

A small collective (``exchange_plan.is_small``: at most
``exchange_plan.SMALL_BYTES``, per rank's part for an all-gather or a
reduce-scatter) is one exchange of messages on *direct sockets*, one socket
per pair of ranks, that the calling thread uses itself. They come from a
:class:`DirectSockets`:

- when every rank shares one host, a Unix socket pair per pair of ranks,
  set up with the shared-memory plane (samehost/plane.py);
- when no two ranks share memory (one rank per host, or shared memory off),
  the TCP mesh (runtime/direct_mesh.py): a TCP connection per pair, opened
  at start-up and authenticated with the ranks' credentials, whose messages
  carry the job's checksum as gRPC chunks do. A synchronous call runs
the exchange in the calling thread itself, as gloo does: no hand-off to the
event loop and back, no asyncio task per message. An asynchronous one (or a
call made while an earlier direct one is still running) runs the same
exchange in the engine's direct thread. Direct jobs take turns, one at a
time in call order, which is the same order on every rank; so the
messages on each socket come in sequence order.

What the loop's path guarantees holds here too:

- every message carries its sender's descriptor, checked as a ring's is;
  a rank that ran the collective another way (a size on the other side of
  the threshold) is found through the plane's signals, or its gRPC stream's
  arrival, and named;
- a peer whose process ends is found by its socket's end, after its last
  report (through the plane, or gRPC's abort) has had a moment to land;
- a peer that sends nothing for the idle timeout is pinged: one that does
  not answer is named as stuck; the collective deadline still applies;
- a refusal, a break or a close reaches the waiting thread through the
  wake socket, and the failure policy decides what is raised, on
  the loop, as for every other collective.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import select
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from typing import Any, Literal, Protocol, TypeVar, overload

import torch

from ..errors import CollectiveTimeoutError, Evidence, FerroGrpcError, PeerError, ProtocolError
from ..failure.watchdog import PROBE_S, RECHECK_S, Watchdog
from ..observe.stats import TCP_MESH
from ..transport.integrity import Checksum
from ..transport.wire import bytes_view
from ..v1 import collective_pb2 as pb
from .context import RankContext
from .exchange_plan import finish, is_small, mismatch, plan, wrong_size
from .jobs import Job

T = TypeVar("T")

# The small collectives (one_exchange.py) that run on the direct sockets on one
# host. A rank whose send finds the socket full reads from it meanwhile, so
# two ranks that both send before they read never wait for each other.
DIRECT_KINDS = frozenset(
    (pb.ALL_REDUCE, pb.BARRIER, pb.BROADCAST, pb.ALL_GATHER, pb.REDUCE_SCATTER, pb.ALL_TO_ALL)
)

# A message's head: the bytes after the head, the collective's seq, the
# length of the sender's serialized descriptor (which comes next), and the
# payload's checksum (0 where the sockets carry none).
_HEAD = struct.Struct("<IQHI")

# The most one read takes from a direct socket.
RECV_BYTES = 256 << 10

# [Note: one wake-up per message between hosts]
# On a link slower than the CPU, a socket turns readable for every burst of
# packets: a 190 KB message over 100 Mbit/s woke the waiting thread (and
# took the interpreter's lock from the training loop) about a hundred
# times. So between hosts, once a message's head has come, its socket's
# SO_RCVLOWAT is set to the bytes it still lacks (select() then reports it
# readable only when they are all there, or the socket ended), and back to
# one byte between messages: two wake-ups a message. Linux caps the value
# to what the receive buffer can hold, and grows the buffer to fit it.
# DiLoCo's int8 exchanges of the char LM at 100 Mbit/s run here (their
# all-to-all and all-gather are small): over 1000 steps the thread that runs
# them took 0.10-0.12 s of CPU per rank, against 0.34-0.45 s (2026-12-04;
# the share of time the model computes moved within the noise).


def missing_bytes(buf: bytearray) -> int:
    """The bytes that the message begun in ``buf`` (what a socket delivered
    past its last whole message) still lacks; 1 between messages."""
    if len(buf) < _HEAD.size:
        return _HEAD.size - len(buf) if buf else 1
    length: int = _HEAD.unpack_from(buf, 0)[0]
    return max(1, _HEAD.size + length - len(buf))


class DirectSockets(Protocol):
    """Where a rank's direct sockets come from, and what tells a thread
    waiting on them to stop: the same-host plane, or the TCP mesh."""

    # The seq of the direct collective running now: what arrives for it
    # another way wakes the waiting thread.
    direct_seq: int
    # Readable when the waiting thread must look at why it should stop.
    wake_r: socket.socket
    # How an error places a peer ("on this host", or "").
    where: str
    # What each message's payload is checked with (None: not checked).
    checksum: Checksum | None
    # How long a rank whose peer's socket ended waits for that peer's last
    # report (the cause it failed with) to land.
    report_wait: float
    # Whether the sockets cross hosts (the TCP mesh): a wire dtype applies,
    # bytes count as sent and received (not local), and a wait probes its
    # peers' hosts (a vanished host closes no socket).
    between_hosts: bool

    def direct_sockets(self) -> dict[int, socket.socket]:
        """One connected socket per other rank."""
        ...

    @property
    def failed(self) -> FerroGrpcError | None:
        """Why these sockets can no longer be used (a report), if so."""
        ...

    def gone_of(self, rank: int) -> FerroGrpcError | None:
        """Why ``rank`` is known to be gone, if it is."""
        ...

    def other_way(self, rank: int, seq: int) -> tuple[pb.Descriptor, str] | None:
        """If ``rank`` ran collective ``seq`` another way: its descriptor,
        and how it ran it."""
        ...

    def wake(self) -> None:
        """Wake the waiting thread (thread-safe)."""
        ...

    def abort(self, abort: pb.Abort) -> None:
        """Tell the ranks these sockets reach why this rank failed, where
        gRPC's own abort does not already."""
        ...


def is_direct(desc: pb.Descriptor, itemsize: int) -> bool:
    """Whether a collective runs on the direct sockets (when every rank
    shares this host, or none shares its host with another): every small
    one (one_exchange.py), an all_to_all only where it is uniform (its
    descriptor holds its size, the same on every rank) with small parts."""
    return desc.kind in DIRECT_KINDS and is_small(desc, itemsize, by_part=True)


class _Prober:
    """A direct wait's probes of the peers it waits for: the ring watchdog's
    rules (Watchdog.probe), run on the loop."""

    def __init__(self, direct: Direct, job: Job, idle: float) -> None:
        self.direct = direct
        self.watchdog = Watchdog(direct.me, direct.ctx.transport, idle, job.name, job.seq)
        # The first probe comes this long after the last progress.
        self.after = min(PROBE_S, idle)
        self.refused: set[int] = set()
        self.silent: dict[int, float] = {}

    def reset(self) -> None:
        self.refused.clear()
        self.silent.clear()

    def run(self, pending: set[int]) -> float:
        """Probe every pending peer once (raise PeerError for one that is
        gone); return how long until the next probe."""
        self.watchdog.waiting = {str(r): (r, "a message from") for r in sorted(pending)}
        self.direct.on_loop(self.watchdog.probe(self.after, self.refused, self.silent))
        return RECHECK_S if self.refused else self.after / 4


class DeadlinePassedError(Exception):
    """A direct job ran past the collective deadline (the loop declares it)."""


class Direct:
    """This rank's end of the direct sockets (see the module docstring)."""

    def __init__(
        self,
        ctx: RankContext,
        plane: DirectSockets,
        check_open: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.ctx = ctx
        self.me = ctx.identity
        self.plane = plane
        self.check_open = check_open
        self.loop = loop
        self.socks: dict[int, socket.socket] = plane.direct_sockets()
        self._checksum = plane.checksum
        # What each socket delivered past its last whole message, and the
        # buffer every read lands in first (one read takes a small message whole).
        self._inbuf = {rank: bytearray() for rank in self.socks}
        self._scratch = memoryview(bytearray(RECV_BYTES))
        # Each TCP socket's SO_RCVLOWAT, as last set (see [Note: one wake-up
        # per message between hosts]).
        self._lowat = {rank: 1 for rank in self.socks}
        self._rank_of = {sock: rank for rank, sock in self.socks.items()}
        # Messages that came ahead of their collective: from a rank that
        # skipped the one this rank waits in (it refused it).
        self._early: dict[tuple[int, int], tuple[bytes, memoryview]] = {}
        # Runs asynchronous direct jobs; one at a time, by their turns.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "ferrogrpc-direct")

    def close(self) -> None:
        self.pool.shutdown(wait=False)

    # ----------------------------------------------------------- running

    def run(self, job: Job) -> tuple[int, int]:
        """Run ``job`` (blocking; in its turn); return the element range it
        produced. Raises FerroGrpcError, or DeadlinePassedError."""
        me = self.me
        world = me.world_size
        # A wire dtype applies to bytes that leave the host (one_exchange.py
        # rounds alike): on the TCP mesh, not on one host's sockets.
        wire = job.wire if self.plane.between_hosts else None
        try:
            outgoing, expect = plan(job, me.rank, world, wire)
            got = self._exchange(job, outgoing, expect, wire)
            return finish(job, me.rank, world, got, wire)
        except (FerroGrpcError, DeadlinePassedError):
            raise
        except Exception as exc:
            # The engine settles only a FerroGrpcError (it aborts the plane
            # and breaks the group): anything else (a torch error, a
            # MemoryError) left the other ranks waiting for this rank's
            # message until the collective deadline (issue 56 item 25).
            raise me.error(
                PeerError, f"internal failure: {exc!r}", op=job.name, seq=job.seq
            ) from exc

    def on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _exchange(
        self,
        job: Job,
        outgoing: dict[int, torch.Tensor],
        expect: dict[int, int],
        wire: torch.dtype | None = None,
    ) -> dict[int, memoryview]:
        plane, seq = self.plane, job.seq
        plane.direct_seq = seq
        desc = job.descriptor.SerializeToString()
        # By tensor (an all-reduce sends one to all): its bytes, as sent,
        # and their checksum (0: none); and what holds narrowed copies.
        views: dict[int, tuple[memoryview, int]] = {}
        kept: list[torch.Tensor] = []
        for dst, data in outgoing.items():
            key = id(data)
            sent = views.get(key)
            if sent is None:
                if wire is not None:
                    data = data.to(wire)
                    kept.append(data)  # the view does not hold its tensor
                view = bytes_view(data)
                crc = self._checksum(view) if self._checksum is not None else 0
                sent = views[key] = (view, crc)
            self._send(job, dst, desc, *sent)
        got: dict[int, memoryview] = {}
        for src in list(expect):
            early = self._early.pop((src, seq), None)
            if early is not None:
                got[src] = self._accept(job, src, desc, early, expect[src])
        pending = set(expect) - set(got)
        skipped: set[int] = set()  # ranks whose next message is for a later seq
        idle, deadline_s = self.ctx.timeouts.idle, self.ctx.timeouts.collective
        start = progress = time.monotonic()
        wake = plane.wake_r
        first = True
        # Between hosts, a peer's vanished host closes no socket: after
        # PROBE_S without a message its host is probed as a ring's
        # watchdog probes it (failure/watchdog.py).
        prober = _Prober(self, job, idle) if plane.between_hosts else None
        next_probe = start + prober.after if prober is not None else float("inf")
        while pending:
            # What has arrived is read before any reason to stop is looked
            # at (a peer that finished and closed has sent all it had to);
            # and those reasons are looked at before any wait: a signal that
            # came before plane.direct_seq named this job woke nobody.
            if not first:
                self._check(job, pending)
            now = time.monotonic()
            if now - start >= deadline_s:
                raise DeadlinePassedError()
            if now - progress >= idle:
                self._ping(job, pending, idle)
                progress = time.monotonic()
                continue
            if prober is not None and now >= next_probe:
                next_probe = time.monotonic() + prober.run(pending)
                now = time.monotonic()
            waits: list[socket.socket] = [self.socks[r] for r in pending - skipped]
            timeout = 0.0 if first else min(idle - (now - progress), deadline_s - (now - start))
            timeout = max(0.0, min(timeout, next_probe - now))
            first = False
            try:
                readable, _, _ = select.select([wake, *waits], [], [], timeout)
            except (OSError, ValueError):  # a socket closed under us: closing
                self.check_open()
                raise
            for sock in readable:
                if sock is wake:
                    self._drain_wake()
                    continue
                src = self._rank_of[sock]
                for their_seq, message in self._pull(job, src):
                    if their_seq < seq:
                        continue  # a collective this rank did not run (refused): dropped
                    if their_seq == seq and src not in pending:
                        raise mismatch(
                            self.me, job, src, job.descriptor, f"sent {job.name}#{seq} twice"
                        )
                    if their_seq > seq:
                        self._early[(src, their_seq)] = message
                        skipped.add(src)  # it skipped this one: a refusal is on its way
                        continue
                    got[src] = self._accept(job, src, desc, message, expect[src])
                    pending.discard(src)
                    progress = time.monotonic()
                    if prober is not None:
                        prober.reset()  # refusals and silences must be unbroken
                        next_probe = progress + prober.after
        stats = self.ctx.stats
        for src, m in got.items():
            if plane.between_hosts:
                stats.received(src, m.nbytes, TCP_MESH)
            else:
                stats.local(src, m.nbytes)
        return got

    # ----------------------------------------------------------- messages

    def _send(self, job: Job, dst: int, desc: bytes, view: memoryview, crc: int) -> None:
        """Send one message (``view``, whose checksum is ``crc``) to ``dst``
        (a peer that takes none of it for the idle timeout is stuck)."""
        head = _HEAD.pack(len(desc) + view.nbytes, job.seq, len(desc), crc) + desc
        sock = self.socks[dst]
        parts = [memoryview(head), view]
        if self.plane.between_hosts:
            self.ctx.stats.sent(dst, view.nbytes, TCP_MESH)
        ended: set[int] = set()  # other peers whose socket ended meanwhile
        try:
            while parts:
                try:
                    sent = sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                while parts and sent >= parts[0].nbytes:
                    sent -= parts[0].nbytes
                    parts.pop(0)
                if parts:
                    parts[0] = parts[0][sent:]
                    # Its socket is full: read what every peer sends meanwhile,
                    # so that ranks sending each other large messages never
                    # wait on each other, two of them or in a cycle (each
                    # blocked on the next one's socket).
                    readable, writable, _ = select.select(
                        [s for r, s in self.socks.items() if r not in ended],
                        [sock],
                        [],
                        self.ctx.timeouts.idle,
                    )
                    for ready in readable:
                        src = self._rank_of[ready]
                        pulled = self._pull(job, src, quiet_end=src != dst)
                        if pulled is None:
                            ended.add(src)  # looked at again if it is waited for
                            continue
                        for seq, message in pulled:
                            if seq >= job.seq:  # older: not run here (refused)
                                self._early[(src, seq)] = message
                    if not readable and not writable:
                        raise self._stuck(job, dst, "to accept a message")
        except FerroGrpcError:
            raise  # (a CollectiveTimeoutError is an OSError too)
        except (OSError, ValueError) as exc:
            raise self._gone(job, dst, exc) from None

    @overload
    def _pull(
        self, job: Job, src: int, *, quiet_end: Literal[False] = ...
    ) -> list[tuple[int, tuple[bytes, memoryview]]]: ...
    @overload
    def _pull(
        self, job: Job, src: int, *, quiet_end: bool
    ) -> list[tuple[int, tuple[bytes, memoryview]]] | None: ...
    def _pull(
        self, job: Job, src: int, *, quiet_end: bool = False
    ) -> list[tuple[int, tuple[bytes, memoryview]]] | None:
        """Read what ``src``'s socket holds, without waiting; return the
        messages it completed, as (seq, (descriptor, data)). A message's
        rest that does not come is a stall, which the idle check catches.
        The socket's end raises (see :meth:`_gone`); with ``quiet_end`` it
        returns None instead (a peer that finished and closed may have
        sent all it had to)."""
        sock, buf = self.socks[src], self._inbuf[src]
        try:
            n = sock.recv_into(self._scratch, len(self._scratch), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        except (OSError, ValueError) as exc:
            if quiet_end:
                return None
            raise self._gone(job, src, exc) from None
        if n == 0:
            if quiet_end:
                return None
            raise self._gone(job, src, EOFError("the socket ended"))
        buf += self._scratch[:n]
        out = []
        at = 0
        while len(buf) - at >= _HEAD.size:
            length, seq, dlen, crc = _HEAD.unpack_from(buf, at)
            end = at + _HEAD.size + length
            if len(buf) < end:
                break
            payload = memoryview(bytes(buf[at + _HEAD.size : end]))
            data = payload[dlen:]
            if self._checksum is not None and self._checksum(data) != crc:
                raise self.me.error(
                    ProtocolError,
                    f"rank {src}'s message for {job.name}#{seq} failed its checksum on the "
                    "direct socket: corrupted in transit",
                    op=job.name,
                    seq=seq,
                    peer=src,
                    evidence=Evidence.FOUND,
                )
            out.append((seq, (bytes(payload[:dlen]), data)))
            at = end
        del buf[:at]
        if self.plane.between_hosts:
            self._wake_when_whole(src, sock, buf)
        return out

    def _wake_when_whole(self, src: int, sock: socket.socket, buf: bytearray) -> None:
        """Set ``src``'s socket to turn readable once the message begun in
        ``buf`` has all arrived ([Note: one wake-up per message between
        hosts])."""
        want = missing_bytes(buf)
        if self._lowat[src] != want:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:
                return  # closed: its next read says so
            self._lowat[src] = want

    def _accept(
        self,
        job: Job,
        src: int,
        desc: bytes,
        message: tuple[bytes, memoryview],
        nbytes: int,
    ) -> memoryview:
        theirs, data = message
        if theirs != desc:
            raise mismatch(self.me, job, src, pb.Descriptor.FromString(theirs), "disagrees")
        if data.nbytes != nbytes:
            raise wrong_size(self.me, job, src, data.nbytes, nbytes)
        return data

    # ----------------------------------------------------------- stopping

    def _check(self, job: Job, pending: set[int]) -> None:
        """Raise if ``job`` must stop: closed or broken here, stopped from the
        loop, refused by some rank, the plane failed, or a pending peer ran
        the collective through the plane instead."""
        self.check_open()
        if job.stopping:
            assert job.error is not None
            raise job.error
        failure = self.ctx.failure
        refusal = failure.refusal(job.name, job.seq)
        if refusal is not None:
            raise refusal
        failed = self.plane.failed  # a report through the plane
        if failed is not None:
            raise self.me.stamp(failed, job.name, job.seq)
        for src in pending:
            # A peer that closed is only a cause if this rank still waits
            # for it (it finished; its messages were read first).
            gone = self.plane.gone_of(src)
            if gone is not None:
                raise self.me.stamp(gone, job.name, job.seq)
            other = self.plane.other_way(src, job.seq)
            if other is not None:
                raise mismatch(self.me, job, src, *other)

    def _drain_wake(self) -> None:
        try:
            while self.plane.wake_r.recv(4096):
                pass
        except OSError:
            pass  # nothing more (or closed)

    def _gone(self, job: Job, src: int, exc: BaseException) -> FerroGrpcError:
        """``src``'s direct socket ended: this rank closed, or its process is
        gone. What it reported through the plane before it went, if anything,
        is the cause."""
        self.check_open()
        failure = self.ctx.failure
        end = time.monotonic() + self.plane.report_wait
        plane = self.plane
        while plane.failed is None and plane.gone_of(src) is None and failure.broken is None:
            left = end - time.monotonic()
            if left <= 0:
                break
            select.select([self.plane.wake_r], [], [], left)
            self._drain_wake()
        self._check(job, {src})
        where = f" {plane.where}" if plane.where else ""
        return self.me.error(
            PeerError,
            f"rank {src}{where} is gone: its direct socket closed ({exc})",
            op=job.name,
            seq=job.seq,
            peer=src,
            evidence=Evidence.UNREACHABLE,
        )

    def _stuck(self, job: Job, peer: int, what: str) -> FerroGrpcError:
        """``peer`` did not do ``what`` for the idle timeout."""
        return self.me.error(
            CollectiveTimeoutError,
            f"waited {self.ctx.timeouts.idle:g}s for rank {peer} "
            f"({self.me.address_of(peer)}) {what}: it is stuck",
            op=job.name,
            seq=job.seq,
            peer=peer,
        )

    def _ping(self, job: Job, pending: set[int], idle: float) -> None:
        """No message for the idle timeout: name a pending peer whose loop
        does not answer a ping (stuck); the others are only waiting."""
        for peer in sorted(pending):
            try:
                self.on_loop(self.ctx.transport.ping(peer, timeout=idle))
            except FerroGrpcError as exc:
                what = f"to send {job.name}#{job.seq}, and it does not answer ({exc.message})"
                raise self._stuck(job, peer, what) from None
