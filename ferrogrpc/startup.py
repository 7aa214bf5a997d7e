"""``init_backend``: read the settings, pick the rendezvous (torch's TCPStore
or the coordinator), and start a Backend through it (backend.py's
``start_backend`` binds where the master's network calls for, and starts
the loop thread and the peer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

from .control.rendezvous import Rendezvous, StoreRendezvous
from .env import Settings
from .errors import ConfigError
from .options import ChunkPolicy, Timeouts, TLSConfig
from .runtime.backend import Backend, start_backend

if TYPE_CHECKING:
    from .elastic.backend import ElasticBackend


@overload
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
    elastic: Literal[False] | None = None,
    min_world_size: int | None = None,
    metrics_port: int | None = None,
    max_world_size: int | None = None,
) -> Backend: ...


@overload
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
    elastic: Literal[True],
    min_world_size: int | None = None,
    metrics_port: int | None = None,
    max_world_size: int | None = None,
) -> ElasticBackend: ...


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
    elastic: bool | None = None,
    min_world_size: int | None = None,
    metrics_port: int | None = None,
    max_world_size: int | None = None,
) -> Backend | ElasticBackend:
    """Join the group and return a blocking :class:`Backend` (an
    :class:`ElasticBackend` with ``elastic=True``).

    Synchronizes: every rank of the group must call it; it returns once every
    rank has joined and the ring has passed a barrier. An elastic group's
    first members return once its first epoch formed; a process that finds
    the group running returns at once, and is admitted at the members' next
    step boundary, in its first ``ElasticState.steps()``.

    Args:
        rank: this process's rank (torch's env:// values; left None, this
            and the next three are read from ``RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR`` and ``MASTER_PORT``).
        world_size: the number of ranks.
        master_addr: the host of the rendezvous, torch's TCPStore, hosted by
            rank 0, or by torchrun's agent under
            ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank is then a
            client).
        master_port: the TCPStore's port.
        coordinator: ``"host:port"`` of a coordinator (``ferrogrpc coordinator``;
            or ``FERROGRPC_COORDINATOR``), which assigns the rank and the
            world size instead: identical replicas need no RANK.
        timeouts: the connect, idle and collective timeouts
            (``FERROGRPC_CONNECT_TIMEOUT``, ``FERROGRPC_IDLE_TIMEOUT``,
            ``FERROGRPC_TIMEOUT``).
        chunk_policy: chunk size and lanes of the gRPC rings
            (``FERROGRPC_CHUNK_BYTES``, ``FERROGRPC_LANES``).
        bind_host: where the gRPC server binds (``FERROGRPC_BIND_HOST``;
            default 127.0.0.1 when the master is on loopback, else 0.0.0.0).
        advertise_host: the address the other ranks dial
            (``FERROGRPC_ADVERTISE_HOST``; default the local address that
            routes to the master, or to the coordinator).
        port: the gRPC port (``FERROGRPC_PORT``; default an ephemeral one).
        checksum: the chunk checksum: True or ``"crc32"`` (the default),
            ``"crc32c"``, or False (``FERROGRPC_CHECKSUM``). All ranks must
            agree: the choice travels in every descriptor.
        tls: mutual TLS between peers (``FERROGRPC_TLS_CERT``, ``_KEY``,
            ``_CA``).
        token: a shared token every peer RPC must carry
            (``FERROGRPC_TOKEN``); see SECURITY.md.
        shm: whether ranks on one host (and network namespace) exchange
            tensor bytes through shared memory (default True;
            ``FERROGRPC_SHM=0`` turns it off). gRPC still carries control.
        elastic: join a group whose membership may change
            (``FERROGRPC_ELASTIC=1``): lost members are dropped and training
            goes on, joiners are admitted between steps. Needs a
            coordinator, the membership's authority. See the README's
            "Elastic training".
        min_world_size: an elastic group's fewest members
            (``FERROGRPC_MIN_WORLD_SIZE``, default 1): below it every
            member raises QuorumLostError. The first epoch forms once this
            many have entered and the coordinator's join window passed (or
            the coordinator's ``--world-size`` entered).
        max_world_size: an elastic group's most members
            (``FERROGRPC_MAX_WORLD_SIZE``, default 0: no limit). Processes
            beyond it wait as hot spares (their model built, their peer
            started, the members connected to them) and are admitted at
            the first step boundary after a member is lost. Under torchrun's
            ``ferrogrpc`` rendezvous both bounds default to ``--nnodes``'
            MIN and MAX nodes of ``LOCAL_WORLD_SIZE`` processes.
        metrics_port: serve Prometheus metrics on this port
            (``FERROGRPC_METRICS_PORT``; default off): bytes by path and
            peer, collectives, their latency, failures by culprit, DDP and
            FSDP waits (README, "Metrics"). Ranks that share a host serve on
            ``metrics_port`` plus their place on the host (0, 1, ...); 0 is
            an ephemeral port per process. Plain HTTP, read-only. Closing
            the backend stops serving.

    Returns:
        A :class:`Backend` for this rank; close it (or use it as a context
        manager) when done.

    Raises:
        ConfigError: a bad argument or environment variable (before anything
            is bound).
        RendezvousError: the group did not form within ``timeouts.connect``
            (plus a margin), or the store or coordinator could not be reached.
        CollectiveTimeoutError: the ring did not pass its first barrier
            within ``timeouts.connect``.

    On failure everything this call bound (ports, the store it hosts, the
    loop thread) is released.
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
        elastic=elastic,
        min_world_size=min_world_size,
        metrics_port=metrics_port,
        max_world_size=max_world_size,
    )
    if s.metrics_port is not None and not 0 <= s.metrics_port < 65536:
        raise ConfigError(f"metrics_port={s.metrics_port} is not a port (0 to 65535)")
    if s.flight_dir:
        from .observe.flight import arm_sigterm

        arm_sigterm()
    connect = s.timeouts.connect
    if s.elastic:
        return _start_elastic(s)
    rendezvous: Rendezvous
    if s.coordinator:
        from .control.coordinator import CoordinatorRendezvous

        rendezvous = CoordinatorRendezvous(s.coordinator, timeout=connect, token=s.token, tls=s.tls)
        target_host = s.coordinator.rsplit(":", 1)[0]
    else:
        r, w, addr, mport = s.require_rendezvous()
        rendezvous = StoreRendezvous(
            r, w, addr, mport, connect, agent_store=s.agent_store, attempt=s.restart_count
        )
        target_host = addr
    return start_backend(s, rendezvous, target_host, rank, world_size)


def _start_elastic(s: Settings) -> ElasticBackend:
    if not s.coordinator:
        # Under torchrun, its ferrogrpc rendezvous exports the coordinator's
        # address (control/torchrun.py); another rendezvous does not.
        torchrun = (
            ". Under torchrun, launch with --rdzv-backend=ferrogrpc "
            "--rdzv-endpoint=HOST:PORT (the coordinator's), which passes it on"
            if s.torchrun_run_id
            else ""
        )
        raise ConfigError(
            "elastic=True needs a coordinator (coordinator='host:port' or "
            "FERROGRPC_COORDINATOR; start one with `ferrogrpc coordinator`): it is the "
            f"membership's authority, so that no rank is a single point of failure{torchrun}"
        )
    if s.min_world_size < 1:
        raise ConfigError(f"min_world_size must be 1 or more, got {s.min_world_size}")
    if s.max_world_size < 0 or 0 < s.max_world_size < s.min_world_size:
        raise ConfigError(
            f"max_world_size must be 0 (no limit) or at least min_world_size "
            f"{s.min_world_size}, got {s.max_world_size}"
        )
    from .control.membership_client import MembershipClient
    from .elastic.backend import ElasticBackend

    client = MembershipClient(
        s.coordinator,
        token=s.token,
        tls=s.tls,
        heartbeat_timeout=s.heartbeat_timeout,
        min_world_size=s.min_world_size,
        max_world_size=s.max_world_size,
        timeout=s.timeouts.connect,
    )
    backend = ElasticBackend(s, client)
    try:
        backend.join()
    except BaseException:
        backend.close()
        raise
    return backend
