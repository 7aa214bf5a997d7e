"""How ranks find each other: torch's env:// TCPStore, or an in-process table.

Each rank publishes the gRPC address it *advertises* (which may differ from
the one it binds, as in containers) and reads everyone else's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import errno
import ipaddress
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import ConfigError, RendezvousError

# How often a rank waiting on the store looks again: at first often (the
# last rank is usually moments away), then at most this far apart. Polling
# (``check``), not ``store.wait``: a wait that times out says neither who is
# missing nor that the ranks disagree, and torch logs C++ warnings for it.
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05
# How often the ranks already published are read for their WORLD_SIZE while
# others are awaited (one store read per rank).
SCAN_S = 0.5
# How much longer a rank 0 that serves the store waits for the others than
# they wait for each other (a fraction of the timeout, at most this): when a
# rank never comes, the clients reach their deadline, and name it, before
# rank 0 gives up and the store closes under them.
HOST_GRACE_S = 1.0


@dataclasses.dataclass(frozen=True)
class RendezvousResult:
    rank: int
    world_size: int
    addresses: list[str]
    # Each rank's session nonce: a stream or abort claiming to come from rank
    # r must carry nonces[r].
    nonces: list[str]
    # Each rank's host key (samehost.plane.host_key): equal non-empty keys share memory.
    hosts: list[str] = dataclasses.field(default_factory=list)


Activity = Callable[[], tuple[str, int]]
"""What a rank is doing, as (collective name, seq), for status reports."""


class Rendezvous(Protocol):
    """How a peer finds the others. ``exchange`` publishes this rank's
    address, nonce and host key and returns the whole table; ``start_heartbeats``
    begins reporting ``activity()`` where the rendezvous keeps a member table
    (the coordinator does; the others do nothing); ``close`` releases it."""

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str, host: str = ""
    ) -> RendezvousResult: ...

    def start_heartbeats(self, activity: Activity) -> None: ...

    async def close(self) -> None: ...


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


def exchange_through_store(
    store: Any,
    prefix: str,
    rank: int,
    world_size: int,
    entry: dict[str, str],
    timeout: float,
    *,
    hosted_here: bool,
    deadline: float | None = None,
    where: str = "the store",
) -> list[dict[str, str]]:
    """The store rendezvous, ours (StoreRendezvous) and the torch backend's
    alike: set this rank's ``entry`` (with its world size) under ``prefix``,
    wait for every rank's, and return the table in rank order. With
    ``hosted_here`` (rank 0 of this job serves the store, and stops it once
    the exchange is done), every rank then says it has read the table, and
    rank 0 returns only once all have: the store's last reader decides when
    it may go. Everything ends by ``deadline`` (``time.monotonic()``;
    default ``timeout`` from now).

    Raises ConfigError when the ranks disagree on the world size (as soon as
    one that disagrees has published), RendezvousError naming the ranks
    still missing at the deadline (``where`` names the store for it), and
    the store's own RuntimeError or OSError."""
    if deadline is None:
        deadline = time.monotonic() + timeout
    store.set(f"{prefix}peer/{rank}", json.dumps({**entry, "world_size": str(world_size)}))
    keys = [f"{prefix}peer/{r}" for r in range(world_size)]
    what = f"its address to {where}"
    if hosted_here and rank == 0:
        deadline += min(HOST_GRACE_S, 0.1 * timeout)
    _await_keys(store, keys, rank, world_size, deadline, timeout, what, hosted_here and rank != 0)
    table: list[dict[str, str]] = [json.loads(store.get(k).decode()) for k in keys]
    _check_world_sizes(dict(enumerate(table)), rank, world_size)
    if hosted_here:
        store.set(f"{prefix}read/{rank}", "1")
        if rank == 0:
            reads = [f"{prefix}read/{r}" for r in range(world_size)]
            _await_keys(store, reads, rank, world_size, deadline, timeout, "that it read the table")
    return table


def _await_keys(
    store: Any,
    keys: list[str],
    rank: int,
    world_size: int,
    deadline: float,
    timeout: float,
    what: str,
    served_by_rank0: bool = False,
) -> None:
    """Wait until every key of ``keys`` (one per rank) is set. Meanwhile the
    entries already published are checked for a world size of their own;
    at ``deadline``, a RendezvousError names the ranks that never set theirs.
    ``served_by_rank0``: the store is this job's rank 0's, which gives up a
    little later than we do; if it closes first all the same, the error
    names the ranks missing at our last look, and says the store closed."""
    pause = POLL_FIRST_S
    scanned = -SCAN_S  # the first look: at once
    peers = "/peer/" in keys[0]
    seen: list[int] = []
    try:
        while not store.check(keys):
            now = time.monotonic()
            if now >= deadline:
                seen = [r for r, k in enumerate(keys) if store.check([k])]
                raise _unpublished(seen, len(keys), rank, world_size, what, f"within {timeout:g}s")
            if peers and now - scanned >= SCAN_S:
                scanned = now
                published = {
                    r: json.loads(store.get(k).decode())
                    for r, k in enumerate(keys)
                    if store.check([k])
                }
                seen = sorted(published)
                _check_world_sizes(published, rank, world_size)
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(pause * 2, POLL_MAX_S)
    except (RuntimeError, OSError) as exc:
        if not (served_by_rank0 and seen):
            raise
        closed = f"before rank 0 closed the store ({_first_line(exc)}: it gave up or died)"
        raise _unpublished(seen, len(keys), rank, world_size, what, closed) from exc


def _unpublished(
    present: list[int], n: int, rank: int, world_size: int, what: str, when: str
) -> RendezvousError:
    missing = [r for r in range(n) if r not in present]
    return RendezvousError(
        f"{_ranks(missing)} of WORLD_SIZE={world_size} did not publish {what} {when} "
        f"(published: {_ranks(present) if present else 'none'}); "
        "check that every rank runs, with the same MASTER_ADDR, MASTER_PORT and "
        "WORLD_SIZE",
        rank=rank,
        world_size=world_size,
    )


def _check_world_sizes(entries: dict[int, dict[str, str]], rank: int, world_size: int) -> None:
    """ConfigError if any of ``entries`` (by rank) was published with
    another world size than this rank's."""
    sizes: dict[str, list[int]] = {}
    for r, e in sorted(entries.items()):
        sizes.setdefault(e.get("world_size", str(world_size)), []).append(r)
    if len(sizes) > 1:
        said = "; ".join(f"WORLD_SIZE={size} on {_ranks(rs)}" for size, rs in sizes.items())
        raise ConfigError(
            f"the ranks disagree on the world size: {said}. Give every rank the same WORLD_SIZE",
            rank=rank,
            world_size=world_size,
        )


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def table_result(rank: int, world_size: int, table: list[dict[str, str]]) -> RendezvousResult:
    return RendezvousResult(
        rank,
        world_size,
        [e["address"] for e in table],
        [e["nonce"] for e in table],
        [e.get("host", "") for e in table],
    )


def _store_socket(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``port`` of the one address ``host`` names, for
    the store to serve on; None where the store must listen on every
    interface, as torch's own does: when that address is not one of this
    machine's (behind NAT, say), or when ``host`` is a name that resolves to
    loopback here (a hostname mapped to 127.0.1.1 locally, which other
    machines resolve to a routable address). Raises OSError if the port is
    taken."""
    try:
        literal = ipaddress.ip_address(host.strip("[]")) is not None
    except ValueError:
        literal = False
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    named = literal or host == "localhost"
    if not named and any(ipaddress.ip_address(i[4][0]).is_loopback for i in infos):
        return None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise
            continue
        return sock
    return None


class StoreRendezvous:
    """torch's env:// rendezvous through ``torch.distributed.TCPStore``.

    Rank 0 hosts the store at ``master_addr:master_port``, unless torchrun's
    agent already does (``agent_store``: ``TORCHELASTIC_USE_AGENT_STORE=True``),
    in which case every rank is a client. Keys live under ``ferrogrpc/<attempt>/`` so that a
    restarted torchrun attempt does not read a stale table.

    A store rank 0 hosts listens only on the address ``master_addr`` names
    (loopback for a single-machine job), not on every interface as torch's
    does (see _store_socket for when it must), and it stops once every rank
    has read the table: rank 0's exchange returns only then. The agent's store under torchrun is
    torchrun's, and lives as long as the job.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout: float,
        *,
        agent_store: bool = False,
        attempt: str = "0",
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
        self.agent_store = agent_store
        self.store: object | None = None
        self.prefix = f"ferrogrpc/{attempt}/"
        # The connect timeout counts from here, init_backend's start: what
        # the rank does before the exchange (binding, the loop) is in it too.
        self.created = time.monotonic()

    def _connect(self, deadline: float) -> object:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        is_master = self.rank == 0 and not self.agent_store
        where = f"{self.master_addr}:{self.master_port}"
        if not is_master:
            # Wait for the store's listener here: torch's own client retries
            # past its timeout, printing a C++ stack trace at every try.
            self._await_listener(deadline)
        fd: int | None = None
        try:
            if is_master:
                sock = _store_socket(self.master_addr, self.master_port)
                fd = sock.detach() if sock is not None else None
            store = TCPStore(
                self.master_addr,
                self.master_port,
                self.world_size,
                is_master=is_master,
                timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())),
                wait_for_workers=False,
                master_listen_fd=fd,
            )
            fd = None  # the store owns it now
            return store
        except (RuntimeError, OSError) as exc:
            if fd is not None:
                os.close(fd)
            role = "host" if is_master else "reach"
            raise RendezvousError(
                f"could not {role} the TCPStore at {where}: {_first_line(exc)}",
                rank=self.rank,
                world_size=self.world_size,
            ) from exc

    def _await_listener(self, deadline: float) -> None:
        """Return once something accepts connections at the master's address;
        RendezvousError at ``deadline``."""
        pause = POLL_FIRST_S
        last: OSError | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                holder = "torchrun's agent" if self.agent_store else "rank 0"
                raise RendezvousError(
                    f"no TCPStore answered at {self.master_addr}:{self.master_port} within "
                    f"{self.timeout:g}s ({last}): is {holder} running, with the same "
                    "MASTER_ADDR and MASTER_PORT?",
                    rank=self.rank,
                    world_size=self.world_size,
                )
            try:
                socket.create_connection(
                    (self.master_addr.strip("[]"), self.master_port), timeout=min(1.0, left)
                ).close()
                return
            except OSError as exc:
                last = exc
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.25)

    def _exchange(self, address: str, nonce: str, host: str) -> list[dict[str, str]]:
        # One deadline for reaching the store, the exchange and (rank 0) the
        # others' reads: FERROGRPC_CONNECT_TIMEOUT bounds them all.
        deadline = self.created + self.timeout
        store: Any = self._connect(deadline)
        self.store = store
        try:
            # A store this job's rank 0 hosts is stopped once every rank has
            # read the table (close()): nobody needs it any more, and it holds
            # every rank's nonce. torchrun's agent store lives on.
            return exchange_through_store(
                store,
                self.prefix,
                self.rank,
                self.world_size,
                {"address": address, "nonce": nonce, "host": host},
                self.timeout,
                hosted_here=not self.agent_store,
                deadline=deadline,
                where=f"{self.master_addr}:{self.master_port}",
            )
        except (RuntimeError, OSError) as exc:
            raise RendezvousError(
                f"the TCPStore at {self.master_addr}:{self.master_port} failed during the "
                f"rendezvous: {_first_line(exc)}",
                rank=self.rank,
                world_size=self.world_size,
            ) from exc

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str, host: str = ""
    ) -> RendezvousResult:
        loop = asyncio.get_running_loop()
        try:
            table = await loop.run_in_executor(None, self._exchange, address, nonce, host)
        finally:
            self.store = None  # a hosting rank 0 stops serving here
        return table_result(self.rank, self.world_size, table)

    def start_heartbeats(self, activity: Activity) -> None:
        """Nothing: a TCPStore keeps no member table."""

    async def close(self) -> None:
        """Release the store (and, on a hosting rank 0, stop serving it)."""
        self.store = None


def _first_line(exc: BaseException) -> str:
    """An exception's first line: torch's C++ errors append their stack."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class LocalRendezvous:
    """An in-process peer table for N peers in one event loop (tests).
    ``hosts`` (one key per rank) stands in for the host keys of ranks that
    offer shared memory, so that one process can play several hosts."""

    def __init__(self, world_size: int, hosts: Sequence[str] | None = None) -> None:
        if hosts is not None and len(hosts) != world_size:
            raise ConfigError(f"hosts has {len(hosts)} keys for {world_size} ranks")
        self.world_size = world_size
        self.hosts = list(hosts) if hosts is not None else None
        self._table: dict[int, tuple[str, str, str]] = {}
        self._ready: asyncio.Event | None = None

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str, host: str = ""
    ) -> RendezvousResult:
        assert rank is not None
        if self._ready is None:
            self._ready = asyncio.Event()
        if self.hosts is not None and host:
            host = self.hosts[rank]
        self._table[rank] = (address, nonce, host)
        if len(self._table) == self.world_size:
            self._ready.set()
        await self._ready.wait()
        ordered = [self._table[r] for r in range(self.world_size)]
        return RendezvousResult(
            rank,
            self.world_size,
            [a for a, _, _ in ordered],
            [n for _, n, _ in ordered],
            [h for _, _, h in ordered],
        )

    def start_heartbeats(self, activity: Activity) -> None:
        """Nothing: there is no member table."""

    async def close(self) -> None:
        """Nothing to release."""
