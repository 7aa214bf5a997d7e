"""Helpers for tests, benchmarks and notebooks: N peers in the running event
loop, injected faults, a process's peak RSS, and local ranks as processes
(``spawn_ranks``, ``free_port``: what ``ferrogrpc launch`` uses)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

from .control.launch import free_port, spawn_ranks
from .control.rendezvous import LocalRendezvous
from .env import resolve_checksum
from .errors import FerroGrpcError
from .observe.stats import Stats
from .ops import kind_name
from .options import ChunkPolicy, Timeouts, TLSConfig
from .runtime.allocator import tune_allocator
from .runtime.backend import Backend
from .runtime.join import message_limit
from .runtime.peer import Peer
from .transport.grpc_streams import GrpcTransport
from .transport.integrity import Checksum
from .transport.streams import MemoryTransport, Transport
from .transport.wire import decode, encode
from .v1 import collective_pb2 as pb


@contextlib.asynccontextmanager
async def local_group(
    world_size: int,
    *,
    transport: Literal["grpc", "shm", "memory"] = "grpc",
    start_timeout: float = 30.0,
    tls: TLSConfig | None = None,
    token: str | None = None,
    faults: Sequence[Fault] = (),
    hosts: Sequence[str] | None = None,
    **options: Any,
) -> AsyncIterator[list[Peer]]:
    """Start ``world_size`` peers in this loop on ephemeral loopback ports and
    yield them in rank order; close them all on exit.

    ``transport="grpc"`` moves every byte over gRPC (the same-host plane
    off), ``"shm"`` exchanges tensor bytes through shared memory with gRPC
    for control (the default of a real job on one host), and ``"memory"``
    uses in-process queues instead of gRPC. ``tls``
    and ``token`` secure the gRPC transport; ``faults`` inject failures (see
    :class:`Fault`). With ``transport="shm"``, ``hosts`` (a key per rank)
    makes the ranks with equal keys one host and the others separate hosts,
    so that the two-level collectives run in one process. Other keyword
    arguments go to :meth:`Peer.start` (``timeouts``, ``chunk_policy``,
    ``checksum``, ``placement``, ``direct``: False keeps small collectives
    between hosts on gRPC instead of the TCP mesh).
    """
    rendezvous = LocalRendezvous(world_size, hosts)
    registry: dict[str, MemoryTransport] = {}
    options.setdefault("timeouts", Timeouts(collective=60.0, idle=20.0, connect=20.0))
    options["shm"] = transport == "shm"

    def make(rank: int) -> Transport:
        hooks = [f for f in faults if f.rank == rank]
        hook = hooks[0].hook() if hooks else None
        if transport == "memory":
            policy = options.get("chunk_policy")
            memory = MemoryTransport(registry, window=policy.window if policy else 4)
            memory.send_hook = hook
            return memory
        limit = message_limit(options.get("chunk_policy") or ChunkPolicy())
        return GrpcTransport(
            "127.0.0.1:0", max_message_bytes=limit, tls=tls, token=token, send_hook=hook
        )

    async with asyncio.timeout(start_timeout):
        peers = await asyncio.gather(
            *(
                Peer.start(
                    rank,
                    world_size,
                    rendezvous=rendezvous,
                    transport=make(rank),
                    token=token,
                    **options,
                )
                for rank in range(world_size)
            )
        )
    try:
        yield list(peers)
    finally:
        await asyncio.gather(*(peer.close() for peer in peers), return_exceptions=True)


def _peer(of: Peer | Backend) -> Peer:
    return of.peer if isinstance(of, Backend) else of


def stats(of: Peer | Backend) -> Stats:
    """The bytes a rank's peer has sent and received, and its collectives run."""
    return _peer(of)._ctx.stats


def broken(of: Peer | Backend) -> FerroGrpcError | None:
    """The failure that broke a rank, or None."""
    return _peer(of)._life.broken


def set_checksum(of: Peer | Backend, checksum: Checksum | bool | str | None) -> None:
    """Switch a rank's chunk checksum between collectives (benchmarks A/B it
    in one run). Every rank must switch at the same point in its sequence of
    collectives: the choice travels in the descriptor."""
    _peer(of)._ctx.checksum = resolve_checksum(checksum, None)


def last_seq(of: Peer | Backend) -> int:
    """The sequence number of the last collective a rank was called for."""
    return _peer(of)._jobs.last_seq


def running(of: Peer | Backend, seq: int) -> bool:
    """Whether collective ``seq`` has started on a rank and not finished."""
    return _peer(of)._jobs.running(seq)


def refusal(of: Peer | Backend, seq: int) -> FerroGrpcError | None:
    """Why collective ``seq`` was refused, if a rank knows some rank refused it."""
    return _peer(of)._jobs.refused(seq)


def checksum(of: Peer | Backend) -> Checksum | None:
    """The chunk checksum a rank uses (None: off)."""
    return _peer(of)._ctx.checksum


class FaultKind(enum.Enum):
    """What an injected fault does to a rank's outgoing chunks."""

    CORRUPT_PAYLOAD = "corrupt_payload"  # flip one payload byte in flight
    WRONG_SEQ = "wrong_seq"  # rewrite a chunk's sequence number (not a ring stream's opening)


@dataclasses.dataclass(frozen=True)
class Fault:
    """Inject ``kind`` into the ``nth`` data message (counting from 0) that
    ``rank`` sends over its transport (a ring's chunk, or a small
    collective's message on a link), through the transport's send hook:
    ``local_group(3, faults=[Fault(rank=1, kind=FaultKind.CORRUPT_PAYLOAD)])``.
    """

    rank: int
    kind: FaultKind = FaultKind.CORRUPT_PAYLOAD
    nth: int = 2
    # Only chunks of this collective kind count ("all_reduce", "broadcast",
    # ...); None counts every data chunk, the startup barrier's included.
    collective: str | None = None

    def hook(self) -> Callable[[int, bytes], bytes]:
        seen = [0]

        def apply(dst: int, message: bytes) -> bytes:
            header, payload = decode(message)
            if payload.nbytes == 0:
                return message  # a bare opening, an end marker, a link's hello, an abort
            if self.kind is FaultKind.WRONG_SEQ and header.nonce:
                # A ring's opening carrying its first chunk: its seq names
                # the collective the whole stream is for (another fault).
                return message
            if self.collective is not None and kind_name(header.kind) != self.collective:
                return message
            index = seen[0]
            seen[0] += 1
            if index != self.nth:
                return message
            if self.kind is FaultKind.CORRUPT_PAYLOAD:
                corrupted = bytearray(message)
                corrupted[-1] ^= 0xFF
                return bytes(corrupted)
            forged = pb.ChunkHeader()
            forged.CopyFrom(header)
            forged.seq += 1000
            return encode(forged, payload)

        return apply


def inject(of: Peer | Backend, fault: Fault) -> None:
    """Inject ``fault`` into the chunks a running rank sends from now on (its
    data chunks are counted from here): for ranks that ``init_backend``
    started; ``local_group`` takes ``faults=`` instead. ``fault.rank`` must
    be the rank's own."""
    peer = _peer(of)
    if fault.rank != peer.rank:
        raise ValueError(f"the fault is for rank {fault.rank}, this is rank {peer.rank}")
    transport = peer._ctx.transport
    if not isinstance(transport, GrpcTransport | MemoryTransport):
        raise TypeError(f"cannot inject faults into a {type(transport).__name__}")
    transport.send_hook = fault.hook()


def rss() -> int:
    """This process's resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_high_water() -> bool:
    # Writing 5 to clear_refs resets the kernel's RSS high-water mark (VmHWM).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _high_water() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def peak_rss(run: Callable[[], object]) -> int:
    """Run ``run()`` and return this process's peak RSS in bytes meanwhile:
    the kernel's exact high-water mark where it can be reset (Linux), else
    sampled every 0.5 ms on a thread (which can miss a short peak). Resets
    the process's VmHWM."""
    if _reset_high_water():
        run()
        return max(_high_water(), rss())
    peak = rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, name="ferrogrpc-rss-sampler", daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return max(peak, rss())


__all__ = [
    "Fault",
    "FaultKind",
    "broken",
    "checksum",
    "free_port",
    "inject",
    "last_seq",
    "local_group",
    "peak_rss",
    "refusal",
    "rss",
    "running",
    "set_checksum",
    "spawn_ranks",
    "stats",
    "tune_allocator",
]
