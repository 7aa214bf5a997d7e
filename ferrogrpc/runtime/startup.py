"""Starting a rank: ``init_backend`` reads the settings, picks the
rendezvous (torch's TCPStore or the coordinator), binds where the master's
network calls for, and starts the Backend's loop thread and peer."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import threading

from ..control.rendezvous import Rendezvous, StoreRendezvous, route_host
from ..errors import FerroGrpcError, RendezvousError
from ..options import ChunkPolicy, Timeouts, TLSConfig
from .allocator import tune_allocator
from .backend import Backend
from .peer import Peer
from .settings import Settings
from .threads import limit_thread_intraop


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _start_loop(threads: int) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        limit_thread_intraop(threads)
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    thread = threading.Thread(target=run, name="ferrogrpc-loop", daemon=True)
    thread.start()
    ready.wait()
    return loop, thread


def init_backend(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    coordinator: str | None = None,
    timeouts: Timeouts | None = None,
    chunk_policy: ChunkPolicy | None = None,
    bind_host: str | None = None,
    advertise_host: str | None = None,
    port: int | None = None,
    checksum: bool | str | None = None,
    tls: TLSConfig | None = None,
    token: str | None = None,
    shm: bool | None = None,
) -> Backend:
    """Join the group and return a blocking :class:`Backend`.

    Arguments left None are read from ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``, and the rendezvous is torch's env://
    TCPStore at ``master_addr:master_port`` (hosted by rank 0, or by torchrun's
    agent under ``TORCHELASTIC_USE_AGENT_STORE=True``). With
    ``FERROGRPC_COORDINATOR=host:port`` (or ``coordinator=``) the coordinator
    assigns the rank and world size instead.

    The gRPC server binds ``bind_host`` (``FERROGRPC_BIND_HOST``; default
    127.0.0.1 when the master is on loopback, else 0.0.0.0) on ``port``
    (``FERROGRPC_PORT``; default an ephemeral port) and advertises
    ``advertise_host`` (``FERROGRPC_ADVERTISE_HOST``; default the local
    address that routes to the master).

    Security: ``tls`` (or ``FERROGRPC_TLS_CERT``/``_KEY``/``_CA``) turns on
    mutual TLS between peers; ``token`` (or ``FERROGRPC_TOKEN``) makes every
    peer refuse RPCs that do not carry the shared token. Chunks carry a
    CRC-32 unless ``checksum=False`` (``FERROGRPC_CHECKSUM=0``);
    ``checksum="crc32c"`` picks CRC32C instead (all ranks must agree; a
    ConfigError names an unknown choice). Ranks that share a host and a
    network namespace exchange tensor bytes through shared memory unless
    ``shm=False`` (``FERROGRPC_SHM=0``); gRPC still carries everything else.

    Returns once every rank has joined and the ring has passed a barrier.
    Raises RendezvousError or CollectiveTimeoutError if that does not happen
    within ``timeouts.connect``.
    """
    s = Settings.from_env().merged(
        rank=rank,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        coordinator=coordinator,
        timeouts=timeouts,
        chunk_policy=chunk_policy,
        bind_host=bind_host,
        advertise_host=advertise_host,
        port=port,
        checksum=checksum,
        tls=tls,
        token=token,
        shm=shm,
    )
    connect = s.timeouts.connect
    rendezvous: Rendezvous
    if s.coordinator:
        from ..control.coordinator import CoordinatorRendezvous

        rendezvous = CoordinatorRendezvous(s.coordinator, timeout=connect, token=s.token, tls=s.tls)
        target_host = s.coordinator.rsplit(":", 1)[0]
    else:
        r, w, addr, mport = s.require_rendezvous()
        rendezvous = StoreRendezvous(
            r, w, addr, mport, connect, agent_store=s.agent_store, attempt=s.restart_count
        )
        target_host = addr
    return start_backend(s, rendezvous, target_host, rank, world_size)


def start_backend(
    s: Settings,
    rendezvous: Rendezvous,
    target_host: str,
    rank: int | None = None,
    world_size: int | None = None,
) -> Backend:
    """Start the loop thread and a peer joining through ``rendezvous``
    (bound and advertised as ``target_host``, the master's or the
    coordinator's host, calls for); return the Backend once the group formed.
    Releases everything if it does not."""
    connect = s.timeouts.connect
    loopback = _is_loopback(target_host)
    bind = s.bind_host or ("127.0.0.1" if loopback else "0.0.0.0")
    advertise = s.advertise_host or ("127.0.0.1" if loopback else route_host(target_host))
    # Before the loop thread allocates anything: it is to share one arena.
    tune_allocator(s.malloc_tuning is not False, cap_arenas=not s.user_arena_max)
    loop, thread = _start_loop(s.reduce_threads)
    start = Peer.start(
        rank,
        world_size,
        rendezvous=rendezvous,
        bind_host=bind,
        port=s.port,
        advertise_host=advertise,
        settings=s,
    )
    starting = asyncio.run_coroutine_threadsafe(start, loop)
    try:
        peer = starting.result(timeout=connect + 30)
    except BaseException as exc:
        # Cancelling the start closes whatever it had bound (Peer.start cleans
        # up on any exception, cancellation included).
        starting.cancel()
        with contextlib.suppress(BaseException):
            starting.result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not loop.is_running() and not loop.is_closed():
            # Shuts down the loop's default executor, whose thread ran the
            # rendezvous: left open, it would outlive the failed call.
            loop.close()
        if isinstance(exc, TimeoutError) and not isinstance(exc, FerroGrpcError):
            raise RendezvousError(f"the group did not form within {connect + 30:g}s") from exc
        raise
    return Backend(peer, loop, thread)
