"""The coordinator: a gRPC rendezvous service that assigns ranks as peers join,
releases them together once ``world_size`` have joined, serves the peer
table and status, receives heartbeats, and answers ``grpc.health.v1``.

:class:`Coordinator` is the service (run it with ``ferrogrpc coordinator`` or
``python -m server``); :class:`CoordinatorRendezvous` is how a peer joins it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .errors import ConfigError, RendezvousError
from .rendezvous import RendezvousResult
from .v1 import rendezvous_pb2 as rpb

logger = logging.getLogger("ferrogrpc.coordinator")

SERVICE = "ferrogrpc.v1.Rendezvous"


@dataclasses.dataclass
class _Member:
    rank: int
    address: str
    peer_id: str
    nonce: str = ""
    last_heartbeat: float = 0.0
    collective: str = ""
    seq: int = 0


class Coordinator:
    """Rank assignment and status for one group of ``world_size`` peers.

    Peers call Join; each is given the lowest free rank (or the rank it asks
    for, if free) and waits until ``world_size`` peers have joined, then all
    receive the same table. A peer that retries Join with the same peer_id
    gets its rank back. Once a round is complete, a Join from a new peer
    starts a new round (a restarted job) with a new run_id.
    """

    def __init__(self, world_size: int, *, min_ranks: int = 1, join_window: float = 5.0) -> None:
        if world_size < 0:
            raise ConfigError(
                f"world_size must be >= 0 (0: decided by who joins), got {world_size}"
            )
        if min_ranks < 1 or join_window <= 0:
            raise ConfigError("min_ranks must be >= 1 and join_window > 0")
        # 0 = elastic: the group is released once at least min_ranks peers
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
        self.run_id = uuid.uuid4().hex[:12]
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.port = 0

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
            run_id=self.run_id,
        )
        # Keep only the latest few rounds' answers.
        while len(self._results) > 4:
            self._results.pop(next(iter(self._results)))
        self._complete.set()

    def _new_round(self) -> None:
        self.world_size = self.fixed_world_size
        self._members.clear()
        self._complete = asyncio.Event()
        self.run_id = uuid.uuid4().hex[:12]
        logger.info("new rendezvous round %s", self.run_id)

    async def join(
        self, request: rpb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rpb.JoinResponse:
        for member in self._members.values():
            if member.peer_id == request.peer_id:
                break
        else:
            if self._complete.is_set():
                self._new_round()
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
                rank = len(self._members)
            else:
                rank = min(set(range(self.world_size)) - taken)
            member = _Member(rank, request.address, request.peer_id, request.nonce, time.time())
            self._members[rank] = member
            logger.info(
                "rank %d joined from %s (%d/%d)",
                rank,
                request.address,
                len(self._members),
                self.world_size,
            )
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
        complete = self._complete
        try:
            await complete.wait()
        except asyncio.CancelledError:
            # The joiner gave up (or died) before the round completed: free
            # its slot so that its replacement does not join a dead address.
            if not complete.is_set() and self._members.get(member.rank) is member:
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
            raise
        # Answer from the round this peer joined, even if a newer round has
        # started since the release.
        result = self._results[id(complete)]
        return rpb.JoinResponse(
            rank=member.rank,  # final: ranks are only renumbered before release
            world_size=result.world_size,
            addresses=result.addresses,
            run_id=result.run_id,
            nonces=result.nonces,
        )

    async def heartbeat(
        self, request: rpb.HeartbeatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rpb.HeartbeatResponse:
        member = self._members.get(request.rank)
        if member is None or request.run_id != self.run_id:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"rank {request.rank} is not in run {self.run_id}"
            )
        assert member is not None
        member.last_heartbeat = time.time()
        member.collective = request.collective
        member.seq = request.seq
        return rpb.HeartbeatResponse()

    async def status(
        self, request: rpb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rpb.StatusResponse:
        return rpb.StatusResponse(
            world_size=self.world_size,
            joined=len(self._members),
            run_id=self.run_id,
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

    # --------------------------------------------------------------- server

    async def start(self, bind: str = "0.0.0.0:0") -> int:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(
                self.join,
                request_deserializer=rpb.JoinRequest.FromString,
                response_serializer=rpb.JoinResponse.SerializeToString,
            ),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                self.heartbeat,
                request_deserializer=rpb.HeartbeatRequest.FromString,
                response_serializer=rpb.HeartbeatResponse.SerializeToString,
            ),
            "Status": grpc.unary_unary_rpc_method_handler(
                self.status,
                request_deserializer=rpb.StatusRequest.FromString,
                response_serializer=rpb.StatusResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise RendezvousError(f"coordinator could not bind {bind}: {exc}") from exc
        if port == 0:
            raise RendezvousError(f"coordinator could not bind {bind}")
        await server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.port = port
        return port

    async def stop(self, grace: float = 2.0) -> None:
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            server, self._server = self._server, None
            await server.stop(grace)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def _stub(channel: grpc.aio.Channel, name: str, request_type: Any, response_type: Any) -> Any:
    return channel.unary_unary(
        f"/{SERVICE}/{name}",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )


class CoordinatorRendezvous:
    """Join a coordinator at ``host:port``; the coordinator assigns the rank
    (unless one is requested) and the world size. After joining, the peer
    heartbeats every ``heartbeat_s`` seconds with its current collective."""

    def __init__(self, target: str, *, timeout: float = 120.0, heartbeat_s: float = 2.0) -> None:
        if ":" not in target:
            raise ConfigError(f"coordinator address {target!r} must be host:port")
        self.target = target
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.peer_id = uuid.uuid4().hex
        self.rank = -1
        self.run_id = ""
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str
    ) -> RendezvousResult:
        channel = grpc.aio.insecure_channel(self.target)
        self._channel = channel
        join = _stub(channel, "Join", rpb.JoinRequest, rpb.JoinResponse)
        request = rpb.JoinRequest(
            address=address,
            requested_rank=-1 if rank is None else rank,
            peer_id=self.peer_id,
            nonce=nonce,
        )
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                response = await join(
                    request, timeout=max(1.0, deadline - time.monotonic()), wait_for_ready=True
                )
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    continue
                await channel.close(None)
                raise RendezvousError(
                    f"joining the coordinator at {self.target} failed: "
                    f"{exc.code().name} {exc.details()}"
                ) from exc
        if world_size is not None and world_size != response.world_size:
            await channel.close(None)
            raise ConfigError(
                f"WORLD_SIZE={world_size} but the coordinator at {self.target} runs "
                f"world_size={response.world_size}"
            )
        self.rank = response.rank
        self.run_id = response.run_id
        return RendezvousResult(
            response.rank, response.world_size, list(response.addresses), list(response.nonces)
        )

    def start_heartbeats(self, current: Callable[[], tuple[str, int]]) -> None:
        """Report ``current()`` (collective name, seq) every heartbeat period."""
        if self._channel is None or self._task is not None:
            return
        beat = _stub(self._channel, "Heartbeat", rpb.HeartbeatRequest, rpb.HeartbeatResponse)

        async def loop() -> None:
            while True:
                collective, seq = current()
                try:
                    await beat(
                        rpb.HeartbeatRequest(
                            rank=self.rank, run_id=self.run_id, collective=collective, seq=seq
                        ),
                        timeout=self.heartbeat_s,
                    )
                except grpc.aio.AioRpcError as exc:
                    logger.debug("heartbeat to %s failed: %s", self.target, exc.code().name)
                await asyncio.sleep(self.heartbeat_s)

        self._task = asyncio.ensure_future(loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close(None)


async def fetch_status(target: str, timeout: float = 5.0) -> rpb.StatusResponse:
    """One Status call to the coordinator at ``target``."""
    async with grpc.aio.insecure_channel(target) as channel:
        status = _stub(channel, "Status", rpb.StatusRequest, rpb.StatusResponse)
        try:
            response: rpb.StatusResponse = await status(rpb.StatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise RendezvousError(
                f"coordinator at {target}: {exc.code().name} {exc.details()}"
            ) from exc
        return response
