"""A process's link to the coordinator of an elastic group (see [Note:
elastic epochs] in membership.py): entering the next epoch, as a
rendezvous for that epoch's peer, and heartbeats, on a thread of their own
so that a busy training loop never delays one."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from ..errors import ConfigError, QuorumLostError, RendezvousError
from ..options import TLSConfig
from ..transport.auth import aio_channel, sync_channel, token_metadata
from ..v1 import rendezvous_pb2 as rpb
from .coordinator_client import LEAVING_S, SERVICE
from .liveness import Watcher
from .membership import LOST_KEY
from .rendezvous import Activity, RendezvousResult

logger = logging.getLogger("ferrogrpc.elastic")


@dataclasses.dataclass
class Beat:
    """What this process tells the coordinator in each heartbeat."""

    epoch: int = 0
    rank: int = 0
    world_size: int = 0
    address: str = ""
    nonce: str = ""
    host: str = ""
    # Syncs of ``epoch`` committed on this member (see [Note: a restarted
    # coordinator] in membership.py).
    committed: int = 0


def reconnect_options(heartbeat_timeout: float) -> list[tuple[str, int]]:
    """Channel options for the links to the coordinator: gRPC's default
    reconnect backoff (1 s, growing 1.6x to 120 s) would leave a member's
    heartbeats off a restarted coordinator for longer than the heartbeat
    timeout after a few seconds away, and the new coordinator would take
    live members for silent. Retry every tenth of the timeout instead."""
    backoff_ms = max(20, min(1000, int(heartbeat_timeout * 100)))
    return [
        ("grpc.initial_reconnect_backoff_ms", backoff_ms),
        ("grpc.min_reconnect_backoff_ms", backoff_ms),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
    ]


class MembershipClient:
    """Enter epochs (on the caller's event loop) and heartbeat (on a thread
    of its own, every quarter of ``heartbeat_timeout``). ``on_heartbeat`` is
    called, on that thread, with every answer."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None,
        tls: TLSConfig | None,
        heartbeat_timeout: float,
        min_world_size: int,
        timeout: float,
        max_world_size: int = 0,
    ) -> None:
        if ":" not in target:
            raise ConfigError(f"coordinator address {target!r} must be host:port")
        self.target = target
        self.tls = tls
        self.timeout = timeout
        self.min_world_size = min_world_size
        self.max_world_size = max_world_size
        self.period = heartbeat_timeout / 4
        self._options = reconnect_options(heartbeat_timeout)
        self._metadata = token_metadata(token)
        # This process's identity in the group, across epochs: random, and
        # shown to nobody but the coordinator.
        self.peer_id = secrets.token_hex(16)
        self.beat = Beat()
        self.activity: Activity = lambda: ("", 0)
        self.latest: rpb.HeartbeatResponse | None = None
        self._latest_at = 0.0
        self.on_heartbeat: Callable[[rpb.HeartbeatResponse], None] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set to beat at once (a new epoch: see set_beat).
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: grpc.aio.Channel | None = None
        # This process's Watch call (see [Note: a stream for a lifetime]).
        self._watcher: Watcher | None = None
        self._watch_channel: grpc.Channel | None = None

    # --------------------------------------------------------------- enter

    async def enter(
        self,
        reason: int,
        epoch: int,
        lost: Sequence[int],
        address: str,
        nonce: str,
        host: str,
    ) -> rpb.EnterResponse:
        """Enter the epoch after ``epoch``; returns its table. Retries while
        the coordinator cannot be reached (a restarted coordinator rebuilds
        its table from heartbeats), up to ``timeout``. Raises QuorumLostError,
        or RendezvousError."""
        if self._channel is None:
            self._channel = aio_channel(self.target, self.tls, self._options)
        call = self._channel.unary_unary(
            f"/{SERVICE}/Enter",
            request_serializer=rpb.EnterRequest.SerializeToString,
            response_deserializer=rpb.EnterResponse.FromString,
        )
        request = rpb.EnterRequest(
            peer_id=self.peer_id,
            address=address,
            nonce=nonce,
            host=host,
            epoch=epoch,
            reason=reason,  # type: ignore[arg-type]
            lost=list(lost),
            min_world_size=self.min_world_size,
            max_world_size=self.max_world_size,
        )
        deadline = time.monotonic() + self.timeout
        logger.info("entering the epoch after %d (%s)", epoch, rpb.EnterReason.Name(reason))
        unreachable = False
        while True:
            try:
                response: rpb.EnterResponse = await call(
                    request,
                    timeout=max(1.0, deadline - time.monotonic()),
                    wait_for_ready=True,
                    metadata=self._metadata,
                )
                return response
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    lost_ranks = _lost_ranks(exc)
                    raise QuorumLostError(
                        exc.details() or "quorum lost",
                        lost=lost_ranks,
                        peer=(lost_ranks[0] if lost_ranks else None),
                    ) from exc
                if code == grpc.StatusCode.OUT_OF_RANGE:
                    raise RendezvousError(
                        f"{exc.details()} before this process was admitted (a spare): it "
                        "has nothing left to train"
                    ) from exc
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ConfigError(
                        f"the coordinator at {self.target} refused this process: {exc.details()}"
                    ) from exc
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    if not unreachable:
                        unreachable = True
                        logger.info(
                            "the coordinator answers UNAVAILABLE (%s): waiting", exc.details()
                        )
                    await asyncio.sleep(0.5)  # the coordinator is away: wait for it
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._spare():
                    # A spare waits for a member to be lost, however long
                    # that takes, while the coordinator says it waits.
                    deadline = time.monotonic() + self.timeout
                    continue
                raise RendezvousError(
                    f"entering the next epoch through the coordinator at {self.target} failed: "
                    f"{code.name} {exc.details()}{self._why(code)}"
                ) from exc

    def _spare(self) -> bool:
        """Whether the coordinator's latest answer, of the last two heartbeat
        periods, says that this process waits as a spare."""
        latest = self.latest
        fresh = time.monotonic() - self._latest_at <= 2 * self.period + 1.0
        return latest is not None and latest.spare and fresh

    def _why(self, code: grpc.StatusCode) -> str:
        """Which of two causes a timeout had: nothing answers at the target,
        or a coordinator answers and the epoch did not form in time."""
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return ""
        channel = self._channel
        up = channel is not None and channel.get_state() is grpc.ChannelConnectivity.READY
        if up:
            return (
                f" (the coordinator is up, but the next epoch did not form within "
                f"{self.timeout:g}s: the other members did not all enter)"
            )
        return (
            f" (no coordinator answered at {self.target} within {self.timeout:g}s, "
            "FERROGRPC_CONNECT_TIMEOUT: is it running, and is the address right?)"
        )

    async def commit(self, epoch: int, n: int) -> bool:
        """The n-th gradient sync of ``epoch`` finished here: True once it did
        on every member, False if the epoch is being replaced (members were
        lost: redo it in the next epoch). One decision for every member, so
        only the coordinator makes it: while none answers (it restarts),
        this waits for one, up to ``timeout`` (RendezvousError after that).
        Guessing would let two members decide differently."""
        if self._channel is None:
            self._channel = aio_channel(self.target, self.tls, self._options)
        call = self._channel.unary_unary(
            f"/{SERVICE}/Commit",
            request_serializer=rpb.CommitRequest.SerializeToString,
            response_deserializer=rpb.CommitResponse.FromString,
        )
        request = rpb.CommitRequest(peer_id=self.peer_id, epoch=epoch, n=n)
        deadline = time.monotonic() + self.timeout
        warned = False
        while True:
            try:
                response: rpb.CommitResponse = await call(
                    request,
                    timeout=max(1.0, deadline - time.monotonic()),
                    wait_for_ready=True,
                    metadata=self._metadata,
                )
                return bool(response.commit)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                away = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if away and time.monotonic() < deadline:
                    if not warned:
                        warned = True
                        logger.warning(
                            "sync %d of epoch %d waits for the coordinator at %s (%s: %s)",
                            n,
                            epoch,
                            self.target,
                            code.name,
                            exc.details(),
                        )
                    await asyncio.sleep(0.1)
                    continue
                raise RendezvousError(
                    f"committing sync {n} of epoch {epoch} through the coordinator at "
                    f"{self.target} failed: {code.name} {exc.details()}"
                    + (
                        f" (no coordinator answered within {self.timeout:g}s, "
                        "FERROGRPC_CONNECT_TIMEOUT)"
                        if away
                        else ""
                    )
                ) from exc

    async def close_channel(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close(None)

    # ---------------------------------------------------------- heartbeats

    def start(self) -> None:
        """Start heartbeating (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="ferrogrpc-heartbeat", daemon=True
            )
            self._thread.start()
        if self._watcher is None:
            channel = self._watch_channel = sync_channel(self.target, self.tls, self._options)
            stub = channel.unary_stream(
                f"/{SERVICE}/Watch",
                request_serializer=rpb.HeartbeatRequest.SerializeToString,
                response_deserializer=None,
            )
            self._watcher = Watcher(lambda: stub(self._request(), metadata=self._metadata))

    def _request(self, leaving: bool = False) -> rpb.HeartbeatRequest:
        with self._lock:
            beat = dataclasses.replace(self.beat)
        collective, seq = self.activity()
        return rpb.HeartbeatRequest(
            rank=beat.rank,
            peer_id=self.peer_id,
            epoch=beat.epoch,
            world_size=beat.world_size,
            address=beat.address,
            nonce=beat.nonce,
            host=beat.host,
            committed=beat.committed,
            min_world_size=self.min_world_size,
            max_world_size=self.max_world_size,
            collective=collective,
            seq=seq,
            leaving=leaving,
        )

    def heartbeat_once(self, timeout: float) -> rpb.HeartbeatResponse | None:
        """One heartbeat now, from this thread (None if it failed)."""
        with sync_channel(self.target, self.tls, self._options) as channel:
            return self._beat(_beat_stub(channel), timeout)

    def _beat(self, stub: Any, timeout: float) -> rpb.HeartbeatResponse | None:
        try:
            response: rpb.HeartbeatResponse = stub(
                self._request(), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            logger.debug("heartbeat to %s failed: %s", self.target, code)
            return None
        self.latest, self._latest_at = response, time.monotonic()
        return response

    def _run(self) -> None:
        with sync_channel(self.target, self.tls, self._options) as channel:
            stub = _beat_stub(channel)
            while not self._stop.is_set():
                response = self._beat(stub, timeout=max(self.period, 0.5))
                if response is not None and self.on_heartbeat is not None:
                    try:
                        self.on_heartbeat(response)
                    except Exception:  # never let a callback stop the heartbeats
                        logger.exception("elastic heartbeat callback failed")
                self._wake.wait(self.period)
                self._wake.clear()

    def set_beat(self, beat: Beat) -> None:
        """This process's place in a new epoch; heartbeat it at once: the
        answer counts the joiners that epoch's next boundary admits (a spare
        once a member was lost), and a restarted coordinator learns sooner."""
        with self._lock:
            self.beat = beat
        self._wake.set()

    def set_committed(self, epoch: int, committed: int) -> None:
        """This member had ``committed`` syncs of ``epoch`` committed."""
        with self._lock:
            if self.beat.epoch == epoch:
                self.beat = dataclasses.replace(self.beat, committed=committed)

    def close(self) -> None:
        """Stop heartbeating, and tell the coordinator this process leaves."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with (
            contextlib.suppress(grpc.RpcError),
            sync_channel(self.target, self.tls, self._options) as channel,
        ):
            _beat_stub(channel)(
                self._request(leaving=True), timeout=LEAVING_S, metadata=self._metadata
            )
        # (After the leave: a Watch that ends then says nothing.)
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._watch_channel is not None:
            self._watch_channel.close()
            self._watch_channel = None


def _beat_stub(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        f"/{SERVICE}/Heartbeat",
        request_serializer=rpb.HeartbeatRequest.SerializeToString,
        response_deserializer=rpb.HeartbeatResponse.FromString,
    )


def _lost_ranks(exc: grpc.aio.AioRpcError) -> list[int]:
    trailing: Any = exc.trailing_metadata() or ()
    for key, value in trailing:
        if key == LOST_KEY and isinstance(value, str) and value:
            return [int(v) for v in value.split(",")]
    return []


class EpochRendezvous:
    """The rendezvous of one epoch's peer: entering that epoch through the
    coordinator (``reason``: join, grow or recover, from ``epoch``, with
    ``lost`` ranks found lost). The answer stays in ``response``."""

    def __init__(
        self, client: MembershipClient, reason: int, epoch: int, lost: Sequence[int] = ()
    ) -> None:
        self.client = client
        self.reason = reason
        self.epoch = epoch
        self.lost = list(lost)
        self.response: rpb.EnterResponse | None = None

    async def exchange(
        self, rank: int | None, world_size: int | None, address: str, nonce: str, host: str = ""
    ) -> RendezvousResult:
        response = await self.client.enter(self.reason, self.epoch, self.lost, address, nonce, host)
        self.response = response
        return RendezvousResult(
            response.rank,
            response.world_size,
            list(response.addresses),
            list(response.nonces),
            list(response.hosts),
        )

    def start_heartbeats(self, activity: Activity) -> None:
        self.client.activity = activity

    async def close(self) -> None:
        """Nothing: the client outlives every epoch."""
