"""The gRPC transport: chunks over grpc.aio, on long-lived lanes. Its
errors become ferrogrpc errors in grpc_errors.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import grpc
import grpc.aio

from ..errors import ConfigError, Evidence, FerroGrpcError, PeerError, ProtocolError
from ..options import DEFAULT_GRPC_WINDOW, TLSConfig
from ..v1 import collective_pb2 as pb
from .auth import TOKEN_METADATA_KEY as TOKEN_METADATA_KEY  # clients' name for it
from .auth import add_port, aio_channel, aio_server, interceptors, token_metadata
from .grpc_errors import abort_with, detached, replied, reply_for, translate
from .streams import OutStream, Replayed, SendHook, StreamHandler, Transport

SERVICE = "ferrogrpc.v1.Collective"
SEND_METHOD = f"/{SERVICE}/Send"
LANE_METHOD = f"/{SERVICE}/Lane"
# What a call's read() returns at the end of the responses (untyped in grpc's stubs).
_EOF: Any = cast(Any, grpc.aio).EOF
ABORT_METHOD = f"/{SERVICE}/Abort"
PING_METHOD = f"/{SERVICE}/Ping"

# [Note: liveness probe] A ping first asks the peer's kernel to accept a TCP
# connection: the kernel completes the handshake even while the peer's
# process is busy or stopped, within a round trip. A refusal (or the host's
# network saying it cannot be reached) means the process is gone: that is an
# answer, Evidence.UNREACHABLE. No answer is not one: a slow link (a round
# trip of half a second or more), lost SYNs and a vanished host (a killed
# container swallows connection attempts) all look alike at first. So the
# attempts start at TCP_CONNECT_S and double, within the ping's timeout,
# and silence through all of them is Evidence.SILENT, which the watchdog
# calls a death only once it has lasted a bound derived from the idle
# timeout (watchdog.silence_bound).
TCP_CONNECT_S = 0.5

# [Note: a fixed receive window]
# gRPC sizes a connection's receive window from its bandwidth-delay
# estimate (BDP probing): twice the estimate, which doubles whenever the
# bytes that arrive while a ping is out exceed two thirds of it. On a busy
# host a receiver that waits for a core delays the ping's answer while its
# sender keeps sending, so the estimate doubles again and again (8 MiB on a
# quiet loopback here; far more beside other work), and a window that large
# fills with chunks the receiver has not read yet: the extra peak RSS of a
# 256 MiB all_reduce at world 4 reached 90-153 MiB on one rank in full test
# runs, where it is 45-65 otherwise (tests/test_memory.py, bar 128). So a
# peer's channels and server turn the probing off and fix the window
# (Settings.grpc_window, FERROGRPC_GRPC_WINDOW, default 16 MiB; "auto"
# leaves gRPC's). The frame size is set with it: without probing gRPC keeps
# 16 KiB frames, and its read tuning (grpc_tuning.py), which wakes the
# reader once a frame has come, would wake it per 16 KiB again. A fixed
# window caps one lane at window / round trip: 16 MiB over a 50 ms round
# trip is about 2.7 Gbit/s. A faster link that far away wants a larger
# window, or "auto".
FRAME_BYTES = 4 << 20

# [Note: connecting ahead] A new epoch of an elastic group first sends its
# joiners the group's state, each member to each joiner, over lane 0: a new
# TCP connection and HTTP/2 handshake each (two round trips, three with
# TLS), which the joiner's receipt waited for. The coordinator names the
# joiners that wait in its heartbeat answers, and their next epoch's servers
# already listen; so a member opens channels to them then
# (:meth:`GrpcTransport.channel_ahead`), and its next epoch's transport takes
# them (``ahead``). Options and credentials are the transport's own, so a
# channel taken is the one it would have opened. Across hosts this saves
# the handshakes' round trips; on one host, measured in
# ElasticBackend._connect_ahead.

# [Note: long-lived lanes] A collective's stream to a rank on a lane
# (transport.open) travels on a long-lived Lane RPC to that rank, not an RPC
# of its own: a new RPC per collective costs each side a call object, a task
# and the HEADERS and trailers (0.5-1 ms a stream on this machine; see
# scripts/grpc_stream_setup.py), every collective, every lane. A lane
# carries one stream at a time, ended by an empty message, and the receiver
# answers each once (an empty Abort: consumed; else why it failed it), as
# the RPC's status did. A ring's stream ends in the background
# (OutStream.end): its lane is busy until that answer comes, after the
# collective returned. A stream opened while every lane to that rank is
# busy gets a new one: lanes are never shared, so no collective waits
# behind another's (and no order between collectives can deadlock). A
# failed or cancelled stream takes its lane down with it; an idle lane is
# reused (at most IDLE_LANES kept per rank and lane index: back-to-back
# collectives settle on two to four). Closing settles the ends still
# pending, then ends every lane and waits until gRPC has finished with it
# (see _Lane.end).
IDLE_LANES = 4
# How long closing waits for each lane to end cleanly (a receiver that is
# gone or stopped costs this, twice at most); see _Lane.end.
LANE_END_S = 0.25

# Room for a chunk's header (an in-band abort's message included) on top of
# its payload, in the receive limit.
HEADER_ROOM = 64 << 10
# The receive limit when none is given: the default chunk policy's largest
# chunk (4 MiB, beyond world size 2) plus its header. Peers pass the limit
# of their own policy (bootstrap.message_limit).
DEFAULT_MAX_MESSAGE = (4 << 20) + HEADER_ROOM


async def _serve_ping(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    # The wall clock, for a traced rank's offset (GrpcTransport.wall_clock).
    return pb.Ping(wall_time=time.time()).SerializeToString()


def _identity(data: bytes) -> bytes:
    return data


class _Lane:
    """One long-lived Lane RPC to a rank: one stream at a time (see [Note:
    long-lived lanes]). Its answers are read in the background, so that a
    stream the receiver failed fails at the sender's next write."""

    def __init__(self, call: Any) -> None:
        # Keep the call referenced: a collected call is cancelled.
        self.call = call
        self.dead = False
        # The answer to the stream now on this lane: bytes, or the
        # exception that ended the lane.
        self.answer: asyncio.Future[bytes] | None = None
        self._reader = asyncio.ensure_future(self._read_answers())

    def begin(self) -> None:
        self.answer = asyncio.get_running_loop().create_future()

    async def _read_answers(self) -> None:
        try:
            while True:
                answer = await self.call.read()
                if answer is _EOF:
                    # (A failed call raises from read(), with its status.)
                    raise PeerError("the lane ended")
                current = self.answer
                if current is None or current.done():
                    raise ProtocolError("an answer to no stream")
                current.set_result(bytes(answer))
        except BaseException as exc:
            self.dead = True
            current = self.answer
            if current is not None and not current.done():
                current.set_exception(exc)
                current.exception()  # (retrieved by the stream, if it asks)
            if isinstance(exc, asyncio.CancelledError):
                raise

    def kill(self) -> None:
        """Cancel the lane's call. Its reader ends once gRPC has taken the
        cancellation in (the transport keeps the lane until then)."""
        self.dead = True
        self.call.cancel()

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the reader ended (gRPC answered its last
        read: no operation of the call is left pending)."""
        self._reader.add_done_callback(lambda _: callback())

    async def end(self, grace: float) -> None:
        """End the lane for good, waiting (``grace`` twice at most) until
        gRPC has finished its operations: an idle lane is half-closed and
        its receiver ends it, any other (or one whose receiver does not end
        it within ``grace``) is cancelled. A call's operations left pending
        when its event loop closes are delivered later to whichever loop
        polls next, which then fails with "Event loop is closed" (two
        backends in one process, an elastic rebuild)."""
        loop = asyncio.get_running_loop()
        if not self.dead and self.answer is None and not self._reader.done():
            deadline = loop.time() + grace
            with contextlib.suppress(Exception):
                async with asyncio.timeout_at(deadline):
                    await self.call.done_writing()
            await asyncio.wait([self._reader], timeout=max(0.0, deadline - loop.time()))
        self.dead = True
        if not self.call.done():
            self.call.cancel()
        if not self._reader.done():
            # The read fails once gRPC has taken the cancellation in.
            await asyncio.wait([self._reader], timeout=grace)
        self._reader.cancel()


class _LaneOutStream:
    """A collective's stream to ``dst`` on one of its lanes (an OutStream)."""

    def __init__(
        self, transport: GrpcTransport, key: tuple[int, int], lane: _Lane, address: str
    ) -> None:
        self._transport = transport
        self._key = key
        self._lane: _Lane | None = lane
        self._dst = key[0]
        self._address = address
        self._hook = transport.send_hook

    def _current(self) -> _Lane:
        lane = self._lane
        if lane is None:
            raise PeerError(f"sending: the stream to rank {self._dst} was closed", peer=self._dst)
        return lane

    async def write(self, message: bytes) -> None:
        if self._hook is not None:
            message = self._hook(self._dst, message)
        lane = self._current()
        assert lane.answer is not None
        if lane.answer.done() or not message:
            # The receiver answered before the end: it failed the stream.
            raise await self._failure(None)
        try:
            await lane.call.write(message)
        except Exception as exc:
            raise await self._failure(exc) from exc

    async def close(self) -> None:
        lane = self._current()
        assert lane.answer is not None
        try:
            if not lane.answer.done():
                await lane.call.write(b"")
            answer = await lane.answer
        except Exception as exc:
            raise await self._failure(exc) from exc
        if answer:
            raise await self._failure(None)
        self._lane = None
        self._transport._release(self._key, lane)

    def end(self) -> None:
        self._transport._end_later(self)

    async def _failure(self, exc: BaseException | None) -> FerroGrpcError:
        """Why the stream failed: the receiver's answer, or the lane's end
        (a failed write only says "the stream is gone"; the status says
        why). The lane is done for."""
        lane = self._current()
        assert lane.answer is not None
        cause: BaseException | None = exc
        try:
            answer = await asyncio.wait_for(asyncio.shield(lane.answer), timeout=1.0)
        except grpc.aio.AioRpcError as status:
            cause = status
        except FerroGrpcError as ended:
            # It ended without a status: a symptom (its report may follow).
            cause = PeerError(
                f"sending: rank {self._dst} at {self._address} ended the lane ({ended.message})",
                peer=self._dst,
                peer_address=self._address,
                evidence=Evidence.SYMPTOM,
            )
        except Exception:
            pass
        else:
            if answer:
                self.cancel()
                return replied(answer, self._dst, self._address)
        self.cancel()
        if isinstance(cause, FerroGrpcError):
            return cause
        if cause is None:
            return ProtocolError(f"sending: an empty message to rank {self._dst}", peer=self._dst)
        return translate(cause, self._dst, self._address, "sending")

    def cancel(self) -> None:
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.kill()


class _GrpcInStream:
    def __init__(self, iterator: AsyncIterator[bytes]) -> None:
        self._iterator = iterator

    async def read(self) -> bytes | None:
        try:
            return await self._iterator.__anext__()
        except StopAsyncIteration:
            return None


class _LaneInStream:
    """One stream of a lane, as the receiver reads it: its messages until the
    empty one that ends it (None then, as at the end of an RPC)."""

    def __init__(self, iterator: AsyncIterator[bytes]) -> None:
        self._iterator = iterator
        self.ended = False
        # The lane itself ended (the sender went away) before the stream did.
        self.cut = False

    async def read(self) -> bytes | None:
        if self.ended:
            return None
        try:
            message = await self._iterator.__anext__()
        except StopAsyncIteration:
            self.ended = self.cut = True
            return None
        if not message:
            self.ended = True
            return None
        return message

    async def drain(self) -> None:
        """Read (and drop) what is left of the stream."""
        while not self.ended:
            await self.read()


class GrpcTransport(Transport):
    """Chunks over grpc.aio: a client-streaming ``Send`` RPC per (collective,
    lane), on one channel (one TCP connection) per lane, with raw-bytes
    (de)serializers so the bulk path builds no protobuf objects.

    ``tls`` turns on mutual TLS (both sides present certificates signed by
    the given root); ``token`` makes the server refuse any RPC without it and
    the client send it on every RPC. ``max_message_bytes`` caps every message
    in and out: gRPC refuses a longer one from its length prefix, before
    buffering it, so set it to the largest legitimate message (one chunk
    plus its header; see bootstrap.message_limit), not more.
    ``send_hook(dst, message)`` may rewrite outgoing messages (fault
    injection in tests)."""

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        tls: TLSConfig | None = None,
        token: str | None = None,
        send_hook: SendHook | None = None,
        window: int | None = DEFAULT_GRPC_WINDOW,
        ahead: dict[str, grpc.aio.Channel] | None = None,
    ) -> None:
        """``ahead``: channels another transport opened with
        :meth:`channel_ahead`, by address; this one takes them as lane 0's,
        and closes those it did not take (see [Note: connecting ahead])."""
        super().__init__()
        self._window = window
        self._bind = bind
        self._advertise_host = advertise_host
        self._max = max_message_bytes
        self._tls = tls
        self._metadata = token_metadata(token)
        self._interceptors = interceptors(token)
        self.send_hook = send_hook
        self._server: grpc.aio.Server | None = None
        self._channels: dict[tuple[int, int], grpc.aio.Channel] = {}
        self._ahead = ahead if ahead is not None else {}
        # Idle long-lived lanes, by (rank, lane index); and every open one.
        self._idle: dict[tuple[int, int], list[_Lane]] = {}
        self._lanes: set[_Lane] = set()
        # Whether close() began (a lane released after that is ended, not
        # kept).
        self._closing = False
        self._handler: StreamHandler | None = None
        self.addresses = []
        self.port = 0

    def _options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self._max),
            ("grpc.max_send_message_length", self._max),
            ("grpc.so_reuseport", 0),
        ]
        if self._window is not None:  # [Note: a fixed receive window]
            options += [
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", self._window),
                ("grpc.http2.max_frame_size", min(FRAME_BYTES, self._window)),
            ]
        return options

    async def start(self, handler: StreamHandler) -> str:
        self._handler = handler
        server = aio_server(self._options(), self._interceptors)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Lane": grpc.stream_stream_rpc_method_handler(self._serve_lane),
                        "Send": grpc.stream_unary_rpc_method_handler(self._serve_send),
                        "Abort": grpc.unary_unary_rpc_method_handler(self._serve_abort),
                        "Ping": grpc.unary_unary_rpc_method_handler(_serve_ping),
                    },
                ),
            )
        )
        try:
            port = add_port(server, self._bind, self._tls)
        except RuntimeError as exc:
            port = 0
            cause: Exception | None = exc
        else:
            cause = None
        if port == 0:
            raise ConfigError(
                f"could not bind the peer's gRPC server on {self._bind} (address in use, or "
                "not an address of this host? see FERROGRPC_BIND_HOST and FERROGRPC_PORT)"
            ) from cause
        await server.start()
        self._server = server
        self.port = port
        host = self._advertise_host or self._bind.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{port}"

    async def _serve_lane(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """A long-lived lane: its streams one after another, each answered
        once (see [Note: long-lived lanes])."""
        iterator = request_iterator.__aiter__()
        origin = context.peer()
        while True:
            try:
                first = await iterator.__anext__()
            except StopAsyncIteration:
                return  # the sender closed the lane
            stream = _LaneInStream(iterator)
            if not first:
                refusal: FerroGrpcError | None = ProtocolError("empty stream")
                stream.ended = True
            else:
                opened = Replayed(first, stream)
                del first  # (the handler holds the opening only while it needs it)
                refusal = await self._take(opened, origin)
            if refusal is not None:
                await context.write(reply_for(refusal))  # at once: the sender stops
                await stream.drain()
            else:
                await stream.drain()
                if stream.cut:
                    return
                await context.write(b"")
            if stream.cut:
                return

    async def _serve_send(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        refusal = await self._take_stream(request_iterator, context.peer())
        if refusal is not None:
            await abort_with(context, refusal)
        return b""

    async def _take_stream(
        self, request_iterator: AsyncIterator[bytes], origin: str
    ) -> FerroGrpcError | None:
        """Hand a stream (an RPC of its own) to the handler; the error to fail
        it with, if any."""
        iterator = request_iterator.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            return ProtocolError("empty stream")
        opened = Replayed(first, _GrpcInStream(iterator))
        del first
        return await self._take(opened, origin)

    async def _take(self, stream: Replayed, origin: str) -> FerroGrpcError | None:
        """Hand a stream to the handler; the error to fail it with, if any.
        The error is returned rebuilt, without a traceback: grpc keeps the
        abort's exception while the client holds the call open, and the
        traceback's frames would keep the refused message alive with it."""
        assert self._handler is not None
        try:
            await self._handler.handle_stream(stream, origin)
        except FerroGrpcError as exc:
            return detached(exc)
        except (ValueError, TypeError, OverflowError, IndexError, KeyError) as exc:
            # Hostile or garbled input that slipped past the checks: a clean
            # error for the client, and this peer goes on serving.
            return ProtocolError(f"malformed stream: {type(exc).__name__}: {str(exc)[:200]}")
        return None

    async def _serve_abort(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        assert self._handler is not None
        try:
            await self._handler.handle_abort(request)
        except FerroGrpcError as exc:
            await abort_with(context, exc)
        except (ValueError, TypeError, OverflowError, IndexError, KeyError) as exc:
            await abort_with(context, ProtocolError(f"malformed abort: {exc!r}"))
        return b""

    def _channel(self, dst: int, lane: int) -> grpc.aio.Channel:
        key = (dst, lane)
        channel = self._channels.get(key)
        if channel is None:
            address = self.addresses[dst]
            channel = self._ahead.pop(address, None) if lane == 0 else None
            channel = self._channels[key] = channel or self._new_channel(address)
        return channel

    def _new_channel(self, address: str) -> grpc.aio.Channel:
        # A private subchannel pool gives every lane its own TCP connection.
        options = [*self._options(), ("grpc.use_local_subchannel_pool", 1)]
        return aio_channel(address, self._tls, options)

    def channel_ahead(self, address: str) -> grpc.aio.Channel:
        """A channel to ``address``, as this transport would open one, that
        starts connecting now: for a later transport's ``ahead`` (see
        [Note: connecting ahead])."""
        channel = self._new_channel(address)
        channel.get_state(try_to_connect=True)
        return channel

    async def open(self, dst: int, lane: int) -> OutStream:
        """A stream to ``dst`` on ``lane``, on an idle long-lived lane or a
        new one (see [Note: long-lived lanes])."""
        key = (dst, lane)
        idle = self._idle.get(key, [])
        while idle and idle[-1].dead:
            idle.pop()
        if idle:
            conn = idle.pop()
        else:
            method = self._channel(dst, lane).stream_stream(
                LANE_METHOD, request_serializer=_identity, response_deserializer=_identity
            )
            conn = _Lane(method(metadata=self._metadata))  # type: ignore[call-arg]
            # Kept until its reader ended, killed or not: close() waits for
            # what is left of every lane (see _Lane.end).
            self._lanes.add(conn)
            conn.when_ended(lambda: self._lanes.discard(conn))
        conn.begin()
        return _LaneOutStream(self, key, conn, self.addresses[dst])

    def _release(self, key: tuple[int, int], lane: _Lane) -> None:
        """A lane whose stream was consumed: idle, for the next one."""
        lane.answer = None
        idle = self._idle.setdefault(key, [])
        if lane.dead or self._closing or len(idle) >= IDLE_LANES:
            lane.kill()
        else:
            idle.append(lane)

    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None:
        method = self._channel(dst, 0).unary_unary(
            ABORT_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            await method(message, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, dst, self.addresses[dst], "abort") from exc

    async def ping(self, dst: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        await self._check_reachable(dst, timeout)
        method = self._channel(dst, 0).unary_unary(
            PING_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            left = max(end - loop.time(), min(timeout, TCP_CONNECT_S))
            await method(b"", timeout=left, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, dst, self.addresses[dst], "ping") from exc

    async def wall_clock(self, dst: int, timeout: float) -> float:
        # The RPC alone (no connection probe first): its round trip is the
        # measurement's error bound, so nothing else goes in it.
        method = self._channel(dst, 0).unary_unary(
            PING_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            reply = await method(b"", timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, dst, self.addresses[dst], "ping") from exc
        return float(pb.Ping.FromString(reply).wall_time)

    async def _check_reachable(self, dst: int, timeout: float) -> None:
        """Raise PeerError unless ``dst``'s host accepts a TCP connection to
        its port within ``timeout``: at once (UNREACHABLE) on a refusal, or
        (SILENT) after attempts of TCP_CONNECT_S, then twice as long each,
        none answered. See [Note: liveness probe]."""
        address = self.addresses[dst]
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        attempt = TCP_CONNECT_S
        tried = 0.0
        while True:
            wait = min(attempt, max(end - loop.time(), 0.0))
            try:
                async with asyncio.timeout(wait):
                    _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            except TimeoutError as exc:
                tried += wait
                if loop.time() < end - 1e-3:
                    attempt *= 2
                    continue
                raise PeerError(
                    f"ping: rank {dst} at {address} gave no answer to connection attempts "
                    f"for {tried:.1f}s",
                    peer=dst,
                    peer_address=address,
                    evidence=Evidence.SILENT,
                ) from exc
            except OSError as exc:
                raise PeerError(
                    f"ping: rank {dst} at {address} accepts no connection ({exc})",
                    peer=dst,
                    peer_address=address,
                    evidence=Evidence.UNREACHABLE,
                ) from exc
            writer.close()
            return

    async def close(self) -> None:
        self._closing = True
        await self._stop_ending()
        lanes, self._lanes, self._idle = self._lanes, set(), {}
        if lanes:
            await asyncio.gather(*(lane.end(LANE_END_S) for lane in lanes))
        channels = [*self._channels.values(), *self._ahead.values()]
        self._channels.clear()
        self._ahead.clear()
        for channel in channels:
            await channel.close(None)
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace=0.5)
        # Break the peer <-> transport reference cycle so sockets close now,
        # not at the next garbage collection.
        self._handler = None
