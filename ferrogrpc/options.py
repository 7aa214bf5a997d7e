"""The option types a user passes (``Timeouts``, ``ChunkPolicy``,
``TLSConfig``): frozen dataclasses, validated on construction. The
environment is read in env.py, never here."""

from __future__ import annotations

import dataclasses

from .errors import ConfigError

# gRPC's receive window on a peer's connections, in bytes
# (``FERROGRPC_GRPC_WINDOW``; see [Note: a fixed receive window] in
# transport/grpc_streams.py).
DEFAULT_GRPC_WINDOW = 16 << 20


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
    lane; across hosts they are cut so that a ring segment has at least 4
    chunks, none under 256 KiB ([Note: chunks on a link] in
    algorithms/schedule.py). The sizes were measured on the 2-core reference
    machine with the choices
    interleaved in one run (docs/benchmarks-history.md): each extra stream costs thread
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
        """Read the PEM files: this process's certificate chain, its private
        key and the CA that signs every rank's certificate.

        Raises:
            ConfigError: a file cannot be read or holds no PEM.
        """
        try:
            with open(cert, "rb") as c, open(key, "rb") as k, open(ca, "rb") as a:
                return cls(c.read(), k.read(), a.read(), server_name)
        except OSError as exc:
            raise ConfigError(f"cannot read TLS files: {exc}") from exc


def check_token(token: object, source: str) -> None:
    """Raise ConfigError unless ``token`` (None or "": no token) can travel
    as gRPC metadata: a string of printable ASCII (0x20 to 0x7E), with no
    space at either end. Otherwise one host accepts it and every RPC then
    fails at the sender with ``INTERNAL: Invalid metadata``, which reads as
    a failed peer. ``source`` names where it came from (the variable, the
    argument). The message never shows the token, only what is wrong."""
    if token is None or token == "":
        return
    rule = (
        "a token may hold only printable ASCII characters (0x20 to 0x7E: letters, digits, "
        "punctuation and space, as a gRPC metadata value must), with no space at either end"
    )
    if not isinstance(token, str):
        raise ConfigError(f"{source}: {rule}; this one is a {type(token).__name__}, not a string")
    for i, c in enumerate(token):
        if not " " <= c <= "~":
            kind = "a control character" if ord(c) < 0x20 or ord(c) == 0x7F else "not ASCII"
            raise ConfigError(
                f"{source}: {rule}; this one has U+{ord(c):04X} ({kind}) at position {i}"
            )
    if token != token.strip(" "):
        raise ConfigError(f"{source}: {rule}; this one starts or ends with a space")
