"""The environment: every variable ferrogrpc reads, read here and only here,
into a rank's :class:`Settings` (the option types themselves, such as
``Timeouts``, are options.py's).

:meth:`Settings.from_env` reads the process environment once;
:meth:`Settings.merged` lays explicit arguments over it. ``init_backend`` and
``Peer.start`` both go through it, so an option left unset has the same
default whichever entry point a user takes.

One variable is read elsewhere: ``FERROGRPC_GRPC_TUNING``, by
transport/grpc_tuning.py, when grpc first loads (which can come before any
``Settings``, and this module costs a tenth of a second to import).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Final

from .errors import ConfigError
from .options import DEFAULT_GRPC_WINDOW, ChunkPolicy, Timeouts, TLSConfig, check_token
from .transport.integrity import Checksum, checksum_by_name, default_checksum

# torch's env:// variables, read when init_backend's arguments are left None.
RANK_ENV: Final = "RANK"
WORLD_SIZE_ENV: Final = "WORLD_SIZE"
MASTER_ADDR_ENV: Final = "MASTER_ADDR"
MASTER_PORT_ENV: Final = "MASTER_PORT"
# The rank's place on its node, as torchrun and `ferrogrpc launch` set it
# (the metrics port's offset).
LOCAL_RANK_ENV: Final = "LOCAL_RANK"
# How many processes torchrun's agent starts on this node.
LOCAL_WORLD_SIZE_ENV: Final = "LOCAL_WORLD_SIZE"
# Set by torchrun's agent, which then already serves the TCPStore.
AGENT_STORE_ENV: Final = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_COUNT_ENV: Final = "TORCHELASTIC_RESTART_COUNT"
# Set by torchrun's agent in every worker: the job's --rdzv-id.
TORCHELASTIC_RUN_ID_ENV: Final = "TORCHELASTIC_RUN_ID"

# ferrogrpc's own variables.
COORDINATOR_ENV: Final = "FERROGRPC_COORDINATOR"
BIND_HOST_ENV: Final = "FERROGRPC_BIND_HOST"
ADVERTISE_HOST_ENV: Final = "FERROGRPC_ADVERTISE_HOST"
PORT_ENV: Final = "FERROGRPC_PORT"
TIMEOUT_ENV: Final = "FERROGRPC_TIMEOUT"
IDLE_TIMEOUT_ENV: Final = "FERROGRPC_IDLE_TIMEOUT"
CONNECT_TIMEOUT_ENV: Final = "FERROGRPC_CONNECT_TIMEOUT"
CHUNK_BYTES_ENV: Final = "FERROGRPC_CHUNK_BYTES"
LANES_ENV: Final = "FERROGRPC_LANES"
TOKEN_ENV: Final = "FERROGRPC_TOKEN"
CHECKSUM_ENV: Final = "FERROGRPC_CHECKSUM"
TLS_CERT_ENV: Final = "FERROGRPC_TLS_CERT"
TLS_KEY_ENV: Final = "FERROGRPC_TLS_KEY"
TLS_CA_ENV: Final = "FERROGRPC_TLS_CA"
TLS_SERVER_NAME_ENV: Final = "FERROGRPC_TLS_SERVER_NAME"
REDUCE_THREADS_ENV: Final = "FERROGRPC_REDUCE_THREADS"
MALLOC_TUNING_ENV: Final = "FERROGRPC_MALLOC_TUNING"
SHM_ENV: Final = "FERROGRPC_SHM"
DIRECT_ENV: Final = "FERROGRPC_DIRECT"
# Lossless packing of float32 chunks on slow links (transport/planes.py).
PACK_ENV: Final = "FERROGRPC_PACK"
# gRPC's receive window on a peer's streams, bytes (see [Note: a fixed
# receive window] in transport/grpc_streams.py); "auto" leaves gRPC's own.
GRPC_WINDOW_ENV: Final = "FERROGRPC_GRPC_WINDOW"
# The coordinator's: the most ranks a round sized by who joins (or an elastic
# epoch) takes.
MAX_RANKS_ENV: Final = "FERROGRPC_MAX_RANKS"
# Elastic groups (elastic/): on, the fewest members, and how long a member
# may be silent before the coordinator removes it.
ELASTIC_ENV: Final = "FERROGRPC_ELASTIC"
MIN_WORLD_SIZE_ENV: Final = "FERROGRPC_MIN_WORLD_SIZE"
HEARTBEAT_TIMEOUT_ENV: Final = "FERROGRPC_HEARTBEAT_TIMEOUT"
# The most members an elastic epoch takes: processes beyond it wait as hot
# spares, admitted at the first boundary after a member is lost.
MAX_WORLD_SIZE_ENV: Final = "FERROGRPC_MAX_WORLD_SIZE"
# torchrun's --nnodes, "MIN:MAX" (or "N"), which its ferrogrpc rendezvous
# (control/torchrun.py) exports to the workers: with LOCAL_WORLD_SIZE it
# gives the defaults of min_world_size and max_world_size (MIN and MAX
# nodes' processes).
TORCHRUN_NNODES_ENV: Final = "FERROGRPC_TORCHRUN_NNODES"
# Observability (observe/): Prometheus metrics per rank, the trace's
# directory, and where the flight recorder dumps when a rank breaks.
METRICS_PORT_ENV: Final = "FERROGRPC_METRICS_PORT"
TRACE_ENV: Final = "FERROGRPC_TRACE"
FLIGHT_DIR_ENV: Final = "FERROGRPC_FLIGHT_DIR"
# Structured logs (observe/logs.py): "json" or "text", and the level.
LOG_ENV: Final = "FERROGRPC_LOG"
LOG_LEVEL_ENV: Final = "FERROGRPC_LOG_LEVEL"
# glibc's own: a user who set these capped the arenas themselves.
GLIBC_ARENA_ENV: Final = "MALLOC_ARENA_MAX"
# ... or chose the mmap or the trim threshold themselves.
GLIBC_MMAP_ENV: Final = "MALLOC_MMAP_THRESHOLD_"
GLIBC_TRIM_ENV: Final = "MALLOC_TRIM_THRESHOLD_"
GLIBC_TUNABLES_ENV: Final = "GLIBC_TUNABLES"

_OFF = ("0", "false", "no", "off")


def _glibc_set(env: Mapping[str, str], variable: str, tunable: str) -> bool:
    """Whether the user set one of glibc's malloc settings: its own
    variable, or its name in GLIBC_TUNABLES."""
    return variable in env or tunable in env.get(GLIBC_TUNABLES_ENV, "")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _nnodes(env: Mapping[str, str]) -> tuple[int, int] | None:
    """torchrun's --nnodes as the ferrogrpc rendezvous exported it (MIN:MAX,
    or N), or None."""
    raw = (env.get(TORCHRUN_NNODES_ENV) or "").strip()
    if not raw:
        return None
    low, _, high = raw.partition(":")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        raise ConfigError(f"{TORCHRUN_NNODES_ENV}={raw!r}: use MIN:MAX or N (nodes)") from None
    if not 1 <= nodes[0] <= nodes[1]:
        raise ConfigError(f"{TORCHRUN_NNODES_ENV}={raw!r}: need 1 <= MIN <= MAX")
    return nodes


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in _OFF:
        return False
    raise ConfigError(f"{name}={env.get(name)!r}: use 1 or 0")


def _tls(env: Mapping[str, str]) -> TLSConfig | None:
    paths = [env.get(n) for n in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)]
    if not any(paths):
        return None
    if not all(paths):
        raise ConfigError(f"mutual TLS needs all of {TLS_CERT_ENV}, {TLS_KEY_ENV} and {TLS_CA_ENV}")
    cert, key, ca = (str(p) for p in paths)
    return TLSConfig.from_files(cert, key, ca, env.get(TLS_SERVER_NAME_ENV) or None)


def resolve_checksum(
    choice: Checksum | bool | str | None, default: Checksum | None
) -> Checksum | None:
    """A ``checksum`` argument: True/False, a name (see integrity.py), a
    function of the payload bytes, or None for ``default``."""
    if choice is None:
        return default
    if choice is True:
        return default_checksum()
    if choice is False:
        return None
    if isinstance(choice, str):
        return checksum_by_name(choice, "checksum")
    return choice


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything configurable, with its source resolved: an explicit
    argument, else the environment, else the default. Rendezvous fields
    stay None when neither gives them (a coordinator may assign them)."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False
    restart_count: str = "0"
    # torchrun's job id, when torchrun's agent started this process.
    torchrun_run_id: str | None = None
    coordinator: str | None = None
    bind_host: str | None = None
    advertise_host: str | None = None
    port: int = 0
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)
    chunk_policy: ChunkPolicy = dataclasses.field(default_factory=ChunkPolicy)
    checksum: Checksum | None = dataclasses.field(default_factory=default_checksum)
    token: str | None = None
    tls: TLSConfig | None = None
    reduce_threads: int = 1
    # None: the entry point's default (on for init_backend, off for the
    # torch.distributed backend, which runs inside the user's own loop).
    malloc_tuning: bool | None = None
    user_arena_max: bool = False
    user_mmap_threshold: bool = False
    user_trim_threshold: bool = False
    shm: bool = True
    # Small collectives between hosts on the TCP mesh (runtime/direct_mesh.py).
    direct: bool = True
    # "auto": float32 ring chunks travel packed where a link is slower than
    # packing; "on", "off": always, never.
    packing: str = "auto"
    # Bytes; None: gRPC's own window, grown from its bandwidth estimate.
    grpc_window: int | None = DEFAULT_GRPC_WINDOW
    max_ranks: int = 1024
    elastic: bool = False
    min_world_size: int = 1
    # 0: no limit (every joiner is admitted at the next boundary).
    max_world_size: int = 0
    # Four heartbeats (every half second) missed in a row: a process that
    # the scheduler starves (two CPU burners on two cores) still beats well
    # within it, and a stopped one is removed within 3 s.
    heartbeat_timeout: float = 2.0
    # None: no metrics (off by default); 0: an ephemeral port.
    metrics_port: int | None = None
    trace_dir: str | None = None
    flight_dir: str | None = None
    # None: the application's own logging configuration (nothing installed).
    log_format: str | None = None
    log_level: str | None = None

    def __post_init__(self) -> None:
        # Every source of a token but the environment (checked, and named,
        # in from_env): init_backend's and Peer.start's token=, pg_options.
        check_token(self.token, "the token argument (token=)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every variable ferrogrpc knows (README, Configuration).
        Raises ConfigError naming a malformed one."""
        env = os.environ if env is None else env
        default = Timeouts()
        timeouts = Timeouts(
            collective=_float(env, TIMEOUT_ENV, default.collective),
            idle=_float(env, IDLE_TIMEOUT_ENV, default.idle),
            connect=_float(env, CONNECT_TIMEOUT_ENV, default.connect),
        )
        policy = ChunkPolicy(chunk_bytes=_int(env, CHUNK_BYTES_ENV), max_lanes=_int(env, LANES_ENV))
        max_ranks = _int(env, MAX_RANKS_ENV)
        if max_ranks is not None and max_ranks < 1:
            raise ConfigError(f"{MAX_RANKS_ENV}={max_ranks} must be 1 or more")
        heartbeat = _float(env, HEARTBEAT_TIMEOUT_ENV, 2.0)
        if heartbeat <= 0:
            raise ConfigError(f"{HEARTBEAT_TIMEOUT_ENV}={heartbeat:g} must be positive")
        min_world = _int(env, MIN_WORLD_SIZE_ENV)
        if min_world is not None and min_world < 1:
            raise ConfigError(f"{MIN_WORLD_SIZE_ENV}={min_world} must be 1 or more")
        max_world = _int(env, MAX_WORLD_SIZE_ENV)
        if max_world is not None and max_world < 0:
            raise ConfigError(f"{MAX_WORLD_SIZE_ENV}={max_world} must be 0 (no limit) or more")
        # Under torchrun's ferrogrpc rendezvous: --nnodes' MIN and MAX nodes
        # of LOCAL_WORLD_SIZE processes each, unless set apart.
        nodes, per_node = _nnodes(env), _int(env, LOCAL_WORLD_SIZE_ENV)
        if nodes is not None and per_node:
            min_world = nodes[0] * per_node if min_world is None else min_world
            max_world = nodes[1] * per_node if max_world is None else max_world
        metrics_port = _int(env, METRICS_PORT_ENV)
        if metrics_port is not None and not 0 <= metrics_port < 65536:
            raise ConfigError(f"{METRICS_PORT_ENV}={metrics_port} is not a port (0 to 65535)")
        log_format = (env.get(LOG_ENV) or "").strip().lower() or None
        if log_format not in (None, "json", "text"):
            raise ConfigError(f"{LOG_ENV}={env.get(LOG_ENV)!r}: use json or text")
        log_level = (env.get(LOG_LEVEL_ENV) or "").strip().upper() or None
        if log_level not in (None, "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"{LOG_LEVEL_ENV}={env.get(LOG_LEVEL_ENV)!r}: use DEBUG, INFO, WARNING or ERROR"
            )
        packing = (env.get(PACK_ENV) or "auto").strip().lower()
        if packing in _OFF:
            packing = "off"
        elif packing in ("1", "true", "yes"):
            packing = "on"
        if packing not in ("auto", "on", "off"):
            raise ConfigError(f"{PACK_ENV}={env.get(PACK_ENV)!r}: use auto, on or off")
        grpc_window: int | None = DEFAULT_GRPC_WINDOW
        raw_window = (env.get(GRPC_WINDOW_ENV) or "").strip().lower()
        if raw_window == "auto":
            grpc_window = None
        elif raw_window:
            grpc_window = _int(env, GRPC_WINDOW_ENV)
            if grpc_window is None or not 65536 <= grpc_window < 2**31:
                raise ConfigError(
                    f"{GRPC_WINDOW_ENV}={env.get(GRPC_WINDOW_ENV)!r}: use bytes (65536 to "
                    "2147483647) or auto"
                )
        token = env.get(TOKEN_ENV) or None
        check_token(token, TOKEN_ENV)
        threads = _int(env, REDUCE_THREADS_ENV)
        if threads is not None and threads < 0:
            raise ConfigError(f"{REDUCE_THREADS_ENV}={threads} must be 0 or more")
        return cls(
            rank=_int(env, RANK_ENV),
            local_rank=_int(env, LOCAL_RANK_ENV),
            world_size=_int(env, WORLD_SIZE_ENV),
            master_addr=env.get(MASTER_ADDR_ENV) or None,
            master_port=_int(env, MASTER_PORT_ENV),
            agent_store=env.get(AGENT_STORE_ENV, "").lower() in ("1", "true", "yes"),
            restart_count=env.get(RESTART_COUNT_ENV, "0") or "0",
            torchrun_run_id=env.get(TORCHELASTIC_RUN_ID_ENV) or None,
            coordinator=env.get(COORDINATOR_ENV) or None,
            bind_host=env.get(BIND_HOST_ENV) or None,
            advertise_host=env.get(ADVERTISE_HOST_ENV) or None,
            port=_int(env, PORT_ENV) or 0,
            timeouts=timeouts,
            chunk_policy=policy,
            checksum=checksum_by_name(env.get(CHECKSUM_ENV) or "crc32", CHECKSUM_ENV),
            token=token,
            tls=_tls(env),
            reduce_threads=1 if threads is None else threads,
            malloc_tuning=(
                None
                if not env.get(MALLOC_TUNING_ENV)
                else env.get(MALLOC_TUNING_ENV, "").lower() not in _OFF
            ),
            shm=_switch(env, SHM_ENV, True),
            direct=_switch(env, DIRECT_ENV, True),
            packing=packing,
            grpc_window=grpc_window,
            max_ranks=1024 if max_ranks is None else max_ranks,
            elastic=_switch(env, ELASTIC_ENV, False),
            min_world_size=1 if min_world is None else min_world,
            max_world_size=max_world or 0,
            heartbeat_timeout=heartbeat,
            metrics_port=metrics_port,
            trace_dir=env.get(TRACE_ENV) or None,
            flight_dir=env.get(FLIGHT_DIR_ENV) or None,
            log_format=log_format,
            log_level=log_level,
            user_arena_max=_glibc_set(env, GLIBC_ARENA_ENV, "arena_max"),
            user_mmap_threshold=_glibc_set(env, GLIBC_MMAP_ENV, "mmap_threshold"),
            user_trim_threshold=_glibc_set(env, GLIBC_TRIM_ENV, "trim_threshold"),
        )

    def merged(self, **given: Any) -> Settings:
        """These settings with every argument in ``given`` that is not None
        laid over them. ``checksum`` may be True/False, a name or a function."""
        unknown = set(given) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown settings: {sorted(unknown)}")
        changes = {k: v for k, v in given.items() if v is not None and k != "checksum"}
        # The checksum may be set to None (off) explicitly: resolve it apart.
        changes["checksum"] = resolve_checksum(given.get("checksum"), self.checksum)
        return dataclasses.replace(self, **changes)

    def require_rendezvous(self) -> tuple[int, int, str, int]:
        """(rank, world_size, master_addr, master_port) for the env://
        rendezvous; ConfigError naming the first one missing."""
        values = (
            (RANK_ENV, self.rank),
            (WORLD_SIZE_ENV, self.world_size),
            (MASTER_ADDR_ENV, self.master_addr),
            (MASTER_PORT_ENV, self.master_port),
        )
        for name, value in values:
            if value is None:
                raise ConfigError(f"{name} is not set and was not passed")
        return self.rank, self.world_size, self.master_addr, self.master_port  # type: ignore[return-value]
