"""``init_backend``: read the settings, pick the rendezvous (torch's TCPStore
or the coordinator), and start a Backend through it (backend.py's
``start_backend`` binds where the master's network calls for, and starts
the loop thread and the peer)."""

from __future__ import annotations

from ..control.rendezvous import Rendezvous, StoreRendezvous
from ..env import Settings
from ..options import ChunkPolicy, Timeouts, TLSConfig
from .backend import Backend, start_backend


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
