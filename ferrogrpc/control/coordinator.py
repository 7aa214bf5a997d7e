"""The coordinator: a gRPC rendezvous service that assigns ranks as peers join,
releases them together once ``world_size`` have joined, serves the peer
table and status, receives heartbeats, and answers ``grpc.health.v1``.

:class:`Coordinator` is the service (run it with ``ferrogrpc coordinator``);
:class:`CoordinatorRendezvous` is how a peer joins it.

With a token (``FERROGRPC_TOKEN``) every call without it is refused with
UNAUTHENTICATED, and with ``FERROGRPC_TLS_*`` every connection is mutual
TLS, exactly as between peers (transport/auth.py); the ranks, ``ferrogrpc
status`` and the healthcheck use the same settings. A joiner's identity is a
random id only it knows, and a rank's slot belongs to exactly one live Join
call. What a joiner may send is capped (see ``Limits``); a request that
breaks a cap is refused at once, and logged in one rate-limited line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..errors import ConfigError, RendezvousError
from ..options import TLSConfig
from ..transport.auth import add_port, aio_server, interceptors
from ..v1 import rendezvous_pb2 as rpb
from .coordinator_client import SERVICE
from .coordinator_client import CoordinatorRendezvous as CoordinatorRendezvous
from .coordinator_client import fetch_status as fetch_status
from .liveness import Watches
from .membership import LOST_KEY, ElasticMembership
from .rounds import GroupOver, NotAdopted, QuorumLostInRound, SettingMismatch

logger = logging.getLogger("ferrogrpc.coordinator")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one joiner may send. ``request_bytes`` is gRPC's receive limit
    (a longer message is refused by gRPC before it is read); the others cap
    a Join's fields, in characters; ``peer_id_min`` keeps ids unguessable
    (and rules out the protobuf default, ""); ``max_ranks`` caps the members
    of a round sized by who joins (``FERROGRPC_MAX_RANKS``); the fixed world size caps
    the others."""

    request_bytes: int = 16 << 10
    address: int = 512
    host: int = 256
    nonce: int = 128
    peer_id_min: int = 16
    peer_id_max: int = 128
    run_id: int = 64
    collective: int = 128
    max_ranks: int = 1024


class _RateLimitedLog:
    """Warnings about bad requests, at most one line per ``interval``
    seconds; the next line says how many were left out meanwhile."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._dropped = 0

    def warning(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._dropped += 1
            return
        more = f" (and {self._dropped} more since)" if self._dropped else ""
        self._last, self._dropped = now, 0
        logger.warning("%s%s", message.replace("\n", " ")[:300], more)


class _Call:
    """One live Join call: the slot it holds is lost if a newer Join with
    the same identity takes the slot over."""

    __slots__ = ("superseded",)

    def __init__(self) -> None:
        self.superseded = asyncio.Event()


@dataclasses.dataclass
class _Member:
    rank: int
    address: str
    peer_id: str
    nonce: str = ""
    host: str = ""
    last_heartbeat: float = 0.0
    collective: str = ""
    seq: int = 0
    # The one live Join call that owns this slot.
    owner: _Call | None = None
    # It said it is closing (a last heartbeat with leaving set).
    left: bool = False


class Coordinator:
    """Rank assignment and status for one group of ``world_size`` peers.

    Peers call Join; each is given the lowest free rank (or the rank it asks
    for, if free) and waits until ``world_size`` peers have joined, then all
    receive the same table. A peer that retries Join with the same peer_id
    gets its rank back: the newer call takes the slot over, and the older
    one, if still waiting, fails with ABORTED, so no two calls ever hold one
    slot. Once a round is complete, a Join from a new peer starts a new
    round (a restarted job) with a new run_id.

    ``token`` and ``tls`` secure it as they secure peers; ``limits`` caps
    what joiners may send.
    """

    def __init__(
        self,
        world_size: int,
        *,
        min_ranks: int = 1,
        join_window: float = 5.0,
        token: str | None = None,
        tls: TLSConfig | None = None,
        limits: Limits | None = None,
        heartbeat_timeout: float = 2.0,
        max_world_size: int = 0,
    ) -> None:
        if world_size < 0:
            raise ConfigError(
                f"world_size must be >= 0 (0: decided by who joins), got {world_size}"
            )
        if min_ranks < 1 or join_window <= 0 or max_world_size < 0:
            raise ConfigError(
                "min_ranks must be >= 1, join_window > 0 and max_world_size >= 0 (0: no limit)"
            )
        # 0 = sized by who joins: the group is released once at least min_ranks peers
        # have joined and join_window seconds pass without another joining,
        # so `docker compose up --scale rank=N` works for any N.
        self.fixed_world_size = world_size
        self.world_size = world_size
        self.min_ranks = min_ranks
        self.join_window = join_window
        self._release_timer: asyncio.TimerHandle | None = None
        self._members: dict[int, _Member] = {}
        # Frozen answers of completed rounds, by their completion event.
        self._results: dict[int, rpb.JoinResponse] = {}
        self._complete = asyncio.Event()
        # When the current run was released (its peer table handed out).
        self._released_at: float | None = None
        self.run_id = uuid.uuid4().hex[:12]
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.port = 0
        self.token = token
        self.tls = tls
        self.limits = limits or Limits()
        self._bad_requests = _RateLimitedLog()
        # Elastic groups (Enter; see [Note: elastic epochs]).
        self.membership = ElasticMembership(
            heartbeat_timeout=heartbeat_timeout,
            join_window=join_window,
            min_world_size=min_ranks,
            max_world_size=max_world_size,
            initial_world_size=world_size,
            max_ranks=self.limits.max_ranks,
        )
        self._silence_task: asyncio.Task[None] | None = None
        # Each elastic process's Watch call (see [Note: a stream for a lifetime]).
        m = self.membership
        self.watches = Watches(  # no grace while a RECOVER round forms (liveness.py)
            m.vanished,
            heartbeat_timeout,
            urgent=lambda: m.round is not None and m.round.reason == rpb.ENTER_RECOVER,
        )
        self.membership.on_recover = self.watches.hurry
        # For the group's metrics (group_metrics.py): peers given a rank by
        # Join, rounds released, and the port they are served on (0: none).
        self.joins = 0
        self.rounds = 0
        self.metrics_port = 0

    # ------------------------------------------------------------- handlers

    def _release(self) -> None:
        self._release_timer = None
        self.world_size = len(self._members)
        logger.info("releasing %d ranks (no new peer for %gs)", self.world_size, self.join_window)
        self._complete_round()

    def _complete_round(self) -> None:
        ordered = [self._members[r] for r in range(self.world_size)]
        self._results[id(self._complete)] = rpb.JoinResponse(
            world_size=self.world_size,
            addresses=[m.address for m in ordered],
            nonces=[m.nonce for m in ordered],
            hosts=[m.host for m in ordered],
            run_id=self.run_id,
        )
        # Keep only the latest few rounds' answers.
        while len(self._results) > 4:
            self._results.pop(next(iter(self._results)))
        self._released_at = time.time()
        self.rounds += 1
        self._complete.set()

    def _new_round(self) -> None:
        self.world_size = self.fixed_world_size
        self._members.clear()
        self._complete = asyncio.Event()
        self._released_at = None
        self.run_id = uuid.uuid4().hex[:12]
        logger.info("new rendezvous round %s", self.run_id)

    @property
    def joined(self) -> int:
        """How many peers hold a slot in the current round."""
        return len(self._members)

    # ----------------------------------------------------- bad requests

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        code: grpc.StatusCode,
        what: str,
        why: str,
    ) -> None:
        """Fail the call at once with ``code``, and log one rate-limited line
        (never the request itself, nor a traceback)."""
        self._bad_requests.warning(f"refused a {what} from {context.peer()}: {why}")
        await context.abort(code, why)

    async def _parse(
        self, raw: bytes, cls: type[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        name = cls.DESCRIPTOR.name
        try:
            message: Message = cls.FromString(raw)
        except DecodeError as exc:
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, name, f"undecodable ({exc})"
            )
        return message

    def _join_problem(
        self,
        request: rpb.JoinRequest | rpb.EnterRequest | rpb.HeartbeatRequest,
        need_address: bool = True,
    ) -> str | None:
        """Why ``request`` (a Join, an Enter, or an elastic heartbeat) breaks a
        limit, or None."""
        lim = self.limits
        for field, most in (("address", lim.address), ("host", lim.host), ("nonce", lim.nonce)):
            n = len(getattr(request, field))
            if n > most:
                return f"{field} of {n} characters; at most {most}"
        if not lim.peer_id_min <= len(request.peer_id) <= lim.peer_id_max:
            return (
                f"peer_id of {len(request.peer_id)} characters; it must be a random id of "
                f"{lim.peer_id_min} to {lim.peer_id_max}"
            )
        if need_address and not request.address:
            return "no address"
        return None

    # ------------------------------------------------------------- handlers

    async def join(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        request: rpb.JoinRequest = await self._parse(raw, rpb.JoinRequest, context)
        problem = self._join_problem(request)
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "Join", problem)
        return (await self._join(request, context)).SerializeToString()

    async def _join(
        self, request: rpb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rpb.JoinResponse:
        call = _Call()
        member = next((m for m in self._members.values() if m.peer_id == request.peer_id), None)
        if member is not None and not self._complete.is_set():
            # A retry of a Join still waiting: this call takes the slot over.
            if member.owner is not None:
                member.owner.superseded.set()
            member.owner = call
            member.address, member.nonce, member.host = request.address, request.nonce, request.host
        elif member is None:
            if self._complete.is_set():
                self._new_round()
            member = await self._assign(request, context, call)
        complete = self._complete
        if not complete.is_set():
            try:
                await _first(complete.wait(), call.superseded.wait())
            except asyncio.CancelledError:
                self._left(member, call, complete)
                raise
        if call.superseded.is_set():
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"rank {member.rank}'s slot was taken over by a newer Join with this peer's id",
            )
        # Answer from the round this peer joined, even if a newer round has
        # started since the release.
        result = self._results[id(complete)]
        return rpb.JoinResponse(
            rank=member.rank,  # final: ranks are only renumbered before release
            world_size=result.world_size,
            addresses=result.addresses,
            run_id=result.run_id,
            nonces=result.nonces,
            hosts=result.hosts,
        )

    async def _assign(
        self, request: rpb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any], call: _Call
    ) -> _Member:
        """A slot for a new joiner, owned by ``call``; refuses at once if
        there is none."""
        taken = set(self._members)
        elastic = self.fixed_world_size == 0
        if request.requested_rank >= 0:
            if (
                elastic
                or request.requested_rank >= self.world_size
                or request.requested_rank in taken
            ):
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"rank {request.requested_rank} is taken or outside world_size "
                    f"{self.world_size}",
                )
            rank = request.requested_rank
        elif elastic:
            if len(self._members) >= self.limits.max_ranks:
                await self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "Join",
                    f"the round already has {len(self._members)} ranks, the most it takes "
                    "(FERROGRPC_MAX_RANKS)",
                )
            rank = len(self._members)
        else:
            free = set(range(self.world_size)) - taken
            if not free:
                await self._refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "Join",
                    f"all {self.world_size} ranks are taken",
                )
            rank = min(free)
        member = _Member(
            rank, request.address, request.peer_id, request.nonce, request.host, time.time()
        )
        member.owner = call
        self._members[rank] = member
        self.joins += 1
        logger.info("rank %d joined (%d/%d)", rank, len(self._members), self.world_size)
        if elastic:
            if self._release_timer is not None:
                self._release_timer.cancel()
                self._release_timer = None
            if len(self._members) >= self.min_ranks:
                self._release_timer = asyncio.get_running_loop().call_later(
                    self.join_window, self._release
                )
        elif len(self._members) == self.world_size:
            self._complete_round()
        return member

    def _left(self, member: _Member, call: _Call, complete: asyncio.Event) -> None:
        """The call gave up (or its joiner died) before the round completed:
        free its slot, if the call still owns it, so that its replacement
        does not join a dead address."""
        if complete.is_set() or member.owner is not call:
            return
        if self._members.get(member.rank) is not member:
            return
        del self._members[member.rank]
        logger.info("rank %d left before the round completed", member.rank)
        if self.fixed_world_size == 0:
            # Elastic ranks are dense: renumber the ones still waiting.
            remaining = sorted(self._members.values(), key=lambda m: m.rank)
            self._members = dict(enumerate(remaining))
            for rank, m in self._members.items():
                m.rank = rank
            if len(self._members) < self.min_ranks and self._release_timer is not None:
                self._release_timer.cancel()
                self._release_timer = None

    async def enter(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """An elastic group's next epoch (see [Note: elastic epochs])."""
        request: rpb.EnterRequest = await self._parse(raw, rpb.EnterRequest, context)
        problem = self._join_problem(request)
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "Enter", problem)
        try:
            response = await self.membership.enter(request)
        except QuorumLostInRound as exc:
            context.set_trailing_metadata(((LOST_KEY, ",".join(map(str, exc.lost))),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except SettingMismatch as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotAdopted as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except GroupOver as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        return response.SerializeToString()

    async def commit(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """An elastic member's finished gradient sync (see [Note: elastic epochs])."""
        request: rpb.CommitRequest = await self._parse(raw, rpb.CommitRequest, context)
        try:
            verdict = await self.membership.commit(request)
        except NotAdopted as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return rpb.CommitResponse(commit=verdict).SerializeToString()

    async def heartbeat(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        request: rpb.HeartbeatRequest = await self._parse(raw, rpb.HeartbeatRequest, context)
        if request.peer_id:
            if self._join_problem(request, need_address=False):
                await self._refuse(
                    context, grpc.StatusCode.INVALID_ARGUMENT, "Heartbeat", "bad fields"
                )
            return self.membership.heartbeat(request).SerializeToString()
        lim = self.limits
        if len(request.run_id) > lim.run_id or len(request.collective) > lim.collective:
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "Heartbeat", "oversized fields"
            )
        member = self._members.get(request.rank)
        if member is None or request.run_id != self.run_id:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"rank {request.rank} is not in run {self.run_id}"
            )
        assert member is not None
        member.last_heartbeat = time.time()
        member.collective = request.collective
        member.seq = request.seq
        if request.leaving:
            member.left = True
            logger.info("rank %d of run %s left", member.rank, self.run_id)
        return rpb.HeartbeatResponse().SerializeToString()

    async def watch(
        self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """An elastic process's Watch call, open for as long as it lives: its
        end tells the coordinator the process is gone (liveness.py)."""
        request: rpb.HeartbeatRequest = await self._parse(raw, rpb.HeartbeatRequest, context)
        if self._join_problem(request, need_address=False):
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "Watch", "bad fields")
        async for item in self.watches.hold(request.peer_id):
            yield item

    async def status(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        await self._parse(raw, rpb.StatusRequest, context)
        group = self.membership
        if group.epoch:
            # An elastic group: its epoch's members by rank, and the joiners
            # waiting; last contact on the membership's clock, made wall time.
            offset = time.time() - group.clock()

            def member(rank: int, peer: str) -> rpb.Member:
                entry = group.entries.get(peer) or group.joiners.get(peer)
                seen = group.seen.get(peer)
                return rpb.Member(
                    rank=rank,
                    address=entry.address if entry is not None else "",
                    last_heartbeat=seen + offset if seen is not None else 0.0,
                )

            members = [member(r, p) for r, p in enumerate(group.members) if p is not None]
            admit, spares = group.waiting()
            return rpb.StatusResponse(
                world_size=len(group.members),
                joined=len(members),
                run_id=group.run_id,
                metrics_port=self.metrics_port,
                epoch=group.epoch,
                members=members,
                joiners=[member(0, p) for p in admit],
                spares=[member(0, p) for p in spares],
                max_world_size=group.max_world_size,
            ).SerializeToString()
        response = rpb.StatusResponse(
            world_size=self.world_size,
            joined=len(self._members),
            run_id=self.run_id,
            metrics_port=self.metrics_port,
            ended=group.ended,
            members=[
                rpb.Member(
                    rank=m.rank,
                    address=m.address,
                    last_heartbeat=m.last_heartbeat,
                    collective=m.collective,
                    seq=m.seq,
                )
                for m in sorted(self._members.values(), key=lambda m: m.rank)
            ],
        )
        return response.SerializeToString()

    # --------------------------------------------------------------- server

    async def start(self, bind: str = "0.0.0.0:0") -> int:
        server = aio_server(
            [
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", self.limits.request_bytes),
            ],
            interceptors(self.token),
        )
        # Raw bytes in: requests are parsed (and refused) in the handlers, so
        # that a malformed one is one log line, not grpc's traceback.
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(method)
            for name, method in (
                ("Join", self.join),
                ("Enter", self.enter),
                ("Commit", self.commit),
                ("Heartbeat", self.heartbeat),
                ("Status", self.status),
            )
        }
        handlers["Watch"] = grpc.unary_stream_rpc_method_handler(self.watch)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = add_port(server, bind, self.tls)
        except RuntimeError as exc:
            raise RendezvousError(f"coordinator could not bind {bind}: {exc}") from exc
        if port == 0:
            raise RendezvousError(f"coordinator could not bind {bind}")
        host = bind.rsplit(":", 1)[0].strip("[]")
        if self.token is None and not _loopback(host):
            logger.warning(
                "the coordinator listens on %s without a token (FERROGRPC_TOKEN): anyone who "
                "can reach this port can join the group, send heartbeats and commits in its "
                "members' names, and so stall or reshape an elastic group (SECURITY.md). Set "
                "FERROGRPC_TOKEN, or bind 127.0.0.1 on a single host",
                bind,
            )
        await server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.port = port
        self._silence_task = asyncio.ensure_future(self._watch_silence())
        return port

    async def _watch_silence(self) -> None:
        """Drop elastic members silent past the heartbeat timeout."""
        period = max(0.05, self.membership.heartbeat_timeout / 8)
        while True:
            await asyncio.sleep(period)
            self.membership.check_silence()

    async def stop(self, grace: float = 2.0) -> None:
        self.watches.stop()
        if self._silence_task is not None:
            self._silence_task.cancel()
            self._silence_task = None
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            server, self._server = self._server, None
            await server.stop(grace)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def run_over(self, silent_s: float) -> bool:
        """Whether a run was released and every rank of it has since left:
        said so, or sent no heartbeat for ``silent_s`` (it crashed or was
        killed). ``--exit-when-done`` ends the coordinator then."""
        if self.membership.over:
            return True  # an elastic group: every member of its epoch left
        released = self._released_at
        if released is None or not self._members:
            return False
        now = time.time()
        return all(
            m.left or now - max(m.last_heartbeat, released) > silent_s
            for m in self._members.values()
        )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def _first(*waits: Any) -> None:
    """Wait until the first of ``waits`` (coroutines) finishes; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
