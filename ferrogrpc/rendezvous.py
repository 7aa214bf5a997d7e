"""How ranks find each other: torch's env:// TCPStore, or an in-process table.

Each rank publishes the gRPC address it *advertises* (which may differ from
the one it binds, as in containers) and reads everyone else's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import socket
from typing import Protocol

from .errors import ConfigError, RendezvousError
from .options import (
    AGENT_STORE_ENV,
    MASTER_ADDR_ENV,
    MASTER_PORT_ENV,
    RANK_ENV,
    RESTART_COUNT_ENV,
    WORLD_SIZE_ENV,
)


@dataclasses.dataclass(frozen=True)
class RendezvousResult:
    rank: int
    world_size: int
    addresses: list[str]
    # Each rank's session nonce: a stream or abort claiming to come from rank
    # r must carry nonces[r].
    nonces: list[str]


class Rendezvous(Protocol):
    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str
    ) -> RendezvousResult:
        """Publish ``address`` and ``nonce``; return the complete peer table."""
        ...


def env_int(name: str, given: int | None) -> int:
    if given is not None:
        return given
    raw = os.environ.get(name)
    if raw is None:
        raise ConfigError(f"{name} is not set and was not passed")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def env_str(name: str, given: str | None) -> str:
    if given is not None:
        return given
    raw = os.environ.get(name)
    if not raw:
        raise ConfigError(f"{name} is not set and was not passed")
    return raw


def use_agent_store() -> bool:
    """True under torchrun, whose agent already serves the store."""
    return os.environ.get(AGENT_STORE_ENV, "").lower() in ("1", "true", "yes")


def route_host(target: str) -> str:
    """The local address that routes to ``target``: the address other ranks can
    reach us on. Uses a UDP connect, which sends no packet."""
    try:
        infos = socket.getaddrinfo(target, 1, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise RendezvousError(f"cannot resolve MASTER_ADDR {target!r}: {exc}") from exc
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)
            except OSError:
                continue
            host = sock.getsockname()[0]
            return f"[{host}]" if family == socket.AF_INET6 else str(host)
    raise RendezvousError(f"no route to MASTER_ADDR {target!r}")


class StoreRendezvous:
    """torch's env:// rendezvous through ``torch.distributed.TCPStore``.

    Rank 0 hosts the store at ``master_addr:master_port``, unless torchrun's
    agent already does (``TORCHELASTIC_USE_AGENT_STORE=True``), in which case
    every rank is a client. Keys live under ``ferrogrpc/<attempt>/`` so that a
    restarted torchrun attempt does not read a stale table.
    """

    def __init__(
        self, rank: int, world_size: int, master_addr: str, master_port: int, timeout: float
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
        if not 0 < master_port < 65536:
            raise ConfigError(f"MASTER_PORT={master_port} is not a valid port")
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.timeout = timeout
        self.store: object | None = None
        self.prefix = f"ferrogrpc/{os.environ.get(RESTART_COUNT_ENV, '0')}/"

    @classmethod
    def from_env(
        cls,
        rank: int | None = None,
        world_size: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        *,
        timeout: float = 120.0,
    ) -> StoreRendezvous:
        return cls(
            env_int(RANK_ENV, rank),
            env_int(WORLD_SIZE_ENV, world_size),
            env_str(MASTER_ADDR_ENV, master_addr),
            env_int(MASTER_PORT_ENV, master_port),
            timeout,
        )

    def _connect(self) -> object:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        is_master = self.rank == 0 and not use_agent_store()
        try:
            return TCPStore(
                self.master_addr,
                self.master_port,
                self.world_size,
                is_master=is_master,
                timeout=datetime.timedelta(seconds=self.timeout),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            role = "host" if is_master else "reach"
            raise RendezvousError(
                f"could not {role} the TCPStore at {self.master_addr}:{self.master_port}: {exc}",
                rank=self.rank,
                world_size=self.world_size,
            ) from exc

    def _exchange(self, address: str, nonce: str) -> list[dict[str, str]]:
        store = self._connect()
        self.store = store
        try:
            entry = json.dumps({"address": address, "nonce": nonce})
            store.set(f"{self.prefix}peer/{self.rank}", entry)  # type: ignore[attr-defined]
            keys = [f"{self.prefix}peer/{r}" for r in range(self.world_size)]
            store.wait(keys, datetime.timedelta(seconds=self.timeout))  # type: ignore[attr-defined]
            return [json.loads(store.get(k).decode()) for k in keys]  # type: ignore[attr-defined]
        except (RuntimeError, OSError) as exc:
            raise RendezvousError(
                f"not every rank published its address to {self.master_addr}:{self.master_port} "
                f"within {self.timeout:g}s: {exc}",
                rank=self.rank,
                world_size=self.world_size,
            ) from exc

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str
    ) -> RendezvousResult:
        loop = asyncio.get_running_loop()
        table = await loop.run_in_executor(None, self._exchange, address, nonce)
        return RendezvousResult(
            self.rank,
            self.world_size,
            [e["address"] for e in table],
            [e["nonce"] for e in table],
        )

    async def close(self) -> None:
        """Release the store (and, on a hosting rank 0, stop serving it)."""
        self.store = None


class LocalRendezvous:
    """An in-process peer table for N peers in one event loop (tests)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._table: dict[int, tuple[str, str]] = {}
        self._ready: asyncio.Event | None = None

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str
    ) -> RendezvousResult:
        assert rank is not None
        if self._ready is None:
            self._ready = asyncio.Event()
        self._table[rank] = (address, nonce)
        if len(self._table) == self.world_size:
            self._ready.set()
        await self._ready.wait()
        ordered = [self._table[r] for r in range(self.world_size)]
        return RendezvousResult(
            rank, self.world_size, [a for a, _ in ordered], [n for _, n in ordered]
        )
