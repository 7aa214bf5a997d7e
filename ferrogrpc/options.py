"""Options (frozen dataclasses, validated on construction) and the names of
every environment variable ferrogrpc reads."""

from __future__ import annotations

import dataclasses
import os
from typing import Final

from .errors import ConfigError

# torch's env:// variables, read when init_backend's arguments are left None.
RANK_ENV: Final = "RANK"
WORLD_SIZE_ENV: Final = "WORLD_SIZE"
MASTER_ADDR_ENV: Final = "MASTER_ADDR"
MASTER_PORT_ENV: Final = "MASTER_PORT"
# Set by torchrun's agent, which then already serves the TCPStore.
AGENT_STORE_ENV: Final = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_COUNT_ENV: Final = "TORCHELASTIC_RESTART_COUNT"

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


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """How long ferrogrpc waits before it gives up and names the culprit.

    - ``collective``: the overall deadline of one collective, in seconds
      (default 300; ``FERROGRPC_TIMEOUT``).
    - ``idle``: after this long without progress (no chunk in or out), a
      rank asks the neighbours it waits for whether they are alive; one that
      does not answer within another ``idle`` is named stuck in a
      :class:`CollectiveTimeoutError` (default 120;
      ``FERROGRPC_IDLE_TIMEOUT``). A neighbour that answers is only waiting
      itself (upstream in the ring, or busy with rank-local work such as
      saving a checkpoint) and is waited for up to ``collective``.
    - ``connect``: how long rendezvous and connecting may take (default 120;
      ``FERROGRPC_CONNECT_TIMEOUT``).
    """

    collective: float = 300.0
    idle: float = 120.0
    connect: float = 120.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"Timeouts.{field.name} must be a positive number, got {value!r}")

    @classmethod
    def from_env(cls) -> Timeouts:
        default = cls()
        return cls(
            collective=_env_float(TIMEOUT_ENV, default.collective),
            idle=_env_float(IDLE_TIMEOUT_ENV, default.idle),
            connect=_env_float(CONNECT_TIMEOUT_ENV, default.connect),
        )


@dataclasses.dataclass(frozen=True)
class ChunkPolicy:
    """How a collective's bytes are cut for the wire.

    - ``chunk_bytes``: payload bytes per chunk message (``FERROGRPC_CHUNK_BYTES``).
    - ``max_lanes``: a large collective is split into up to this many
      independent rings, each on its own stream and TCP connection
      (``FERROGRPC_LANES``).
    - ``lane_min_bytes``: a lane gets at least this many bytes.
    - ``window``: chunks buffered per stream by the in-memory transport (the
      gRPC transport is bounded by HTTP/2 flow control).

    Left as None, chunks are 1 MiB at world size 2 and 4 MiB beyond, on one
    lane, as measured on the 2-core reference machine with the choices
    interleaved in one run (BENCHMARKS.md): each extra stream costs thread
    wake-ups for every message, which cost more than the parallelism gains
    (1 MiB on 4 lanes took 16-21% longer at world size 2). More lanes can
    pay off where cores are plentiful. Every rank must use the same policy;
    a difference is a ProtocolError.
    """

    chunk_bytes: int | None = None
    max_lanes: int | None = None
    lane_min_bytes: int = 4 << 20
    window: int = 4

    def __post_init__(self) -> None:
        if self.chunk_bytes is not None and not 64 <= self.chunk_bytes <= (64 << 20):
            raise ConfigError(f"chunk_bytes must be in [64, 64 MiB], got {self.chunk_bytes}")
        if self.max_lanes is not None and not 1 <= self.max_lanes <= 16:
            raise ConfigError(f"max_lanes must be in [1, 16], got {self.max_lanes}")
        if self.lane_min_bytes < 1:
            raise ConfigError(f"lane_min_bytes must be positive, got {self.lane_min_bytes}")
        if self.window < 1:
            raise ConfigError(f"window must be at least 1, got {self.window}")

    def resolve(self, world_size: int) -> tuple[int, int]:
        """(chunk_bytes, max_lanes) for a group of ``world_size`` ranks."""
        small = world_size <= 2
        chunk = (
            self.chunk_bytes if self.chunk_bytes is not None else (1 << 20 if small else 4 << 20)
        )
        lanes = self.max_lanes if self.max_lanes is not None else 1
        return chunk, lanes

    @classmethod
    def from_env(cls) -> ChunkPolicy:
        chunk = os.environ.get(CHUNK_BYTES_ENV)
        lanes = os.environ.get(LANES_ENV)
        return cls(
            chunk_bytes=_env_int(CHUNK_BYTES_ENV, 0) if chunk else None,
            max_lanes=_env_int(LANES_ENV, 0) if lanes else None,
        )


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS between peers: every peer presents ``certificate_chain``
    (PEM) with ``private_key`` and accepts only peers whose certificates chain
    to ``root_certificates``. ``server_name``, if set, is the name checked in
    every peer's certificate instead of the dialled host (handy when one
    certificate is shared by all ranks).

    From files: ``TLSConfig.from_files(cert, key, ca)``; from the environment:
    ``FERROGRPC_TLS_CERT``, ``FERROGRPC_TLS_KEY``, ``FERROGRPC_TLS_CA`` and
    ``FERROGRPC_TLS_SERVER_NAME``.
    """

    certificate_chain: bytes
    private_key: bytes
    root_certificates: bytes
    server_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("certificate_chain", "private_key", "root_certificates"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or b"-----BEGIN" not in value:
                raise ConfigError(f"TLSConfig.{name} must be PEM bytes")

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str, server_name: str | None = None) -> TLSConfig:
        try:
            with open(cert, "rb") as c, open(key, "rb") as k, open(ca, "rb") as a:
                return cls(c.read(), k.read(), a.read(), server_name)
        except OSError as exc:
            raise ConfigError(f"cannot read TLS files: {exc}") from exc

    @classmethod
    def from_env(cls) -> TLSConfig | None:
        paths = [os.environ.get(n) for n in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)]
        if not any(paths):
            return None
        if not all(paths):
            raise ConfigError(
                f"mutual TLS needs all of {TLS_CERT_ENV}, {TLS_KEY_ENV} and {TLS_CA_ENV}"
            )
        cert, key, ca = (str(p) for p in paths)
        return cls.from_files(cert, key, ca, os.environ.get(TLS_SERVER_NAME_ENV) or None)
