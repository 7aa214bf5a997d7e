"""The coordinator's clients: :class:`CoordinatorRendezvous`, how a rank
joins a coordinator (coordinator.py) and heartbeats to it, and
:func:`fetch_status`, what ``ferrogrpc status`` asks it. Both carry the
token and mutual TLS of the rank's settings (transport/auth.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

from ..errors import ConfigError, RendezvousError
from ..options import TLSConfig
from ..transport.auth import aio_channel, token_metadata
from ..v1 import rendezvous_pb2 as rpb
from .rendezvous import RendezvousResult

logger = logging.getLogger("ferrogrpc.coordinator")

# How long a closing rank tries to tell the coordinator it is leaving.
LEAVING_S = 1.0
# How long before its Join gives up a rank asks the coordinator's status, to
# say why the group did not form: up and waiting for ranks (and how many
# joined), or not answering at all. Asked before, not after: a Join that
# ended frees its slot, and the count would leave this rank out.
STATUS_LEAD_S = 0.5

SERVICE = "ferrogrpc.v1.Rendezvous"


def _stub(channel: grpc.aio.Channel, name: str, request_type: Any, response_type: Any) -> Any:
    return channel.unary_unary(
        f"/{SERVICE}/{name}",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )


class CoordinatorRendezvous:
    """Join a coordinator at ``host:port``; the coordinator assigns the rank
    (unless one is requested) and the world size. After joining, the peer
    heartbeats every ``heartbeat_s`` seconds with its current collective.
    ``token`` and ``tls`` are the coordinator's (the ranks' own settings,
    ``FERROGRPC_TOKEN`` and ``FERROGRPC_TLS_*``). Its identity across retries
    of Join is a random id it never shows anyone but the coordinator."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 120.0,
        heartbeat_s: float = 2.0,
        token: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        if ":" not in target:
            raise ConfigError(f"coordinator address {target!r} must be host:port")
        self.target = target
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.tls = tls
        self._metadata = token_metadata(token)
        self.peer_id = secrets.token_hex(16)
        self.rank = -1
        self.run_id = ""
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        # The connect timeout counts from here, init_backend's start.
        self.created = time.monotonic()

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str, host: str = ""
    ) -> RendezvousResult:
        channel = aio_channel(self.target, self.tls)
        self._channel = channel
        join = _stub(channel, "Join", rpb.JoinRequest, rpb.JoinResponse)
        request = rpb.JoinRequest(
            address=address,
            requested_rank=-1 if rank is None else rank,
            peer_id=self.peer_id,
            nonce=nonce,
            host=host,
        )
        deadline = self.created + self.timeout
        status = asyncio.ensure_future(self._status_before(channel, deadline))
        try:
            while True:
                try:
                    response = await join(
                        request,
                        timeout=max(1.0, deadline - time.monotonic()),
                        wait_for_ready=True,
                        metadata=self._metadata,
                    )
                    break
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                        await asyncio.sleep(0.5)
                        continue
                    await channel.close(None)
                    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        raise RendezvousError(self._not_formed(await status)) from exc
                    raise RendezvousError(
                        f"joining the coordinator at {self.target} failed: "
                        f"{code.name} {exc.details()}"
                    ) from exc
        finally:
            status.cancel()
        if world_size is not None and world_size != response.world_size:
            await channel.close(None)
            raise ConfigError(
                f"WORLD_SIZE={world_size} but the coordinator at {self.target} runs "
                f"world_size={response.world_size}"
            )
        self.rank = response.rank
        self.run_id = response.run_id
        return RendezvousResult(
            response.rank,
            response.world_size,
            list(response.addresses),
            list(response.nonces),
            list(response.hosts),
        )

    async def _status_before(
        self, channel: grpc.aio.Channel, deadline: float
    ) -> rpb.StatusResponse | None:
        """The coordinator's status, asked STATUS_LEAD_S before ``deadline``;
        None if it did not answer (nothing listens there, or it is not a
        coordinator)."""
        await asyncio.sleep(max(0.0, deadline - time.monotonic() - STATUS_LEAD_S))
        ask = _stub(channel, "Status", rpb.StatusRequest, rpb.StatusResponse)
        try:
            answer: rpb.StatusResponse = await ask(
                rpb.StatusRequest(), timeout=STATUS_LEAD_S, metadata=self._metadata
            )
        except grpc.aio.AioRpcError:
            return None
        return answer

    def _not_formed(self, status: rpb.StatusResponse | None) -> str:
        """Why the group did not form within the timeout, from ``status``."""
        if status is None:
            return (
                f"no coordinator answered at {self.target} within {self.timeout:g}s: is "
                "`ferrogrpc coordinator` running there, and reachable from this host?"
            )
        ranks = [str(m.rank) for m in status.members]
        listed = f" ({'rank' if len(ranks) == 1 else 'ranks'} {', '.join(ranks)})" if ranks else ""
        of = f" of {status.world_size}" if status.world_size else ""
        joined = f"{status.joined}{of} joined{listed}"
        if status.world_size:
            waits = f"it waits for all {status.world_size}"
        else:
            waits = "it sizes the group by who joins, and waits for at least its --min-ranks"
        return (
            f"the coordinator at {self.target} is up, but the group did not form within "
            f"{self.timeout:g}s: {joined}; {waits}. Start the missing ranks, or raise "
            "FERROGRPC_CONNECT_TIMEOUT"
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
                        metadata=self._metadata,
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
                # Say this rank is leaving (best effort): a coordinator run
                # with --exit-when-done ends once every rank has.
                beat = _stub(
                    self._channel, "Heartbeat", rpb.HeartbeatRequest, rpb.HeartbeatResponse
                )
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                    await beat(
                        rpb.HeartbeatRequest(rank=self.rank, run_id=self.run_id, leaving=True),
                        timeout=LEAVING_S,
                        metadata=self._metadata,
                    )
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close(None)


async def fetch_status(
    target: str,
    timeout: float = 5.0,
    *,
    token: str | None = None,
    tls: TLSConfig | None = None,
) -> rpb.StatusResponse:
    """One Status call to the coordinator at ``target``, with its ``token``
    and ``tls``."""
    async with aio_channel(target, tls) as channel:
        status = _stub(channel, "Status", rpb.StatusRequest, rpb.StatusResponse)
        try:
            response: rpb.StatusResponse = await status(
                rpb.StatusRequest(), timeout=timeout, metadata=token_metadata(token)
            )
        except grpc.aio.AioRpcError as exc:
            raise RendezvousError(
                f"coordinator at {target}: {exc.code().name} {exc.details()}"
            ) from exc
        return response
