"""Transports move framed chunk messages between peers; algorithms never see grpc.

A transport offers outgoing streams to a destination rank (one per
collective and lane) and delivers incoming streams to the peer's
:class:`StreamHandler`, plus a small unary control message (abort). Two
implementations: :class:`GrpcTransport` (the real one) and
:class:`MemoryTransport` (in-process queues, for fast deterministic tests).
This module is the one place where grpc errors become ferrogrpc errors.
"""

from __future__ import annotations

import abc
import asyncio
import hmac
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, cast

import grpc
import grpc.aio

from .errors import ERROR_CLASSES, ConfigError, FerroGrpcError, PeerError, ProtocolError
from .options import TLSConfig

SERVICE = "ferrogrpc.v1.Collective"
SEND_METHOD = f"/{SERVICE}/Send"
ABORT_METHOD = f"/{SERVICE}/Abort"
PING_METHOD = f"/{SERVICE}/Ping"


class InStream(Protocol):
    async def read(self) -> bytes | None:
        """The next message, or None at the end of the stream."""
        ...


class OutStream(Protocol):
    async def write(self, message: bytes) -> None: ...

    async def close(self) -> None:
        """Finish the stream and wait until the receiver has consumed it."""
        ...

    def cancel(self) -> None: ...


class StreamHandler(Protocol):
    async def handle_stream(self, first: bytes, stream: InStream, origin: str) -> None:
        """Take an incoming stream; return once it has been consumed. Raising
        FerroGrpcError fails the stream at the sender with that message."""
        ...

    async def handle_abort(self, message: bytes) -> None: ...


class Transport(abc.ABC):
    """Moves bytes between ranks. ``start`` binds and returns the address to
    advertise; ``connect`` learns everyone's addresses."""

    addresses: list[str]

    @abc.abstractmethod
    async def start(self, handler: StreamHandler) -> str: ...

    def connect(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)

    @abc.abstractmethod
    async def open(self, dst: int, lane: int) -> OutStream: ...

    @abc.abstractmethod
    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None: ...

    @abc.abstractmethod
    async def ping(self, dst: int, timeout: float) -> None:
        """Return if ``dst`` answers within ``timeout``; raise PeerError if not
        (with ``gone`` set when ``dst`` cannot be reached at all)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


ERROR_KEY = "ferrogrpc-error"
CULPRIT_KEY = "ferrogrpc-culprit"


def _peer_error(exc: BaseException, dst: int, address: str, what: str) -> FerroGrpcError:
    """Translate a failed RPC into the error a user sees."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        details = exc.details() or ""
        trailing: dict[str, str] = {}
        pairs = cast(Sequence[tuple[str, Any]], exc.trailing_metadata() or ())
        for key, value in pairs:
            trailing[str(key)] = str(value)
        reported = ERROR_CLASSES.get(trailing.get(ERROR_KEY, ""))
        if reported is not None:
            # The receiver failed the stream on purpose and said why.
            culprit = int(trailing.get(CULPRIT_KEY, dst))
            relayed = reported(
                f"rank {dst} reported: {details}",
                peer=culprit if culprit >= 0 else None,
                peer_address=address if culprit == dst else None,
            )
            relayed.reported = True
            return relayed
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ProtocolError(details, peer=dst, peer_address=address)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return PeerError(
                f"{what}: rank {dst} refused our credentials: {details}",
                peer=dst,
                peer_address=address,
            )
        if code == grpc.StatusCode.ABORTED:
            return PeerError(details, peer=dst, peer_address=address)
        err = PeerError(
            f"{what}: rank {dst} at {address} failed ({code.name}: {details})",
            peer=dst,
            peer_address=address,
        )
        err.gone = code == grpc.StatusCode.UNAVAILABLE
        # grpc reports a write that raced with the receiver failing the stream
        # as a local INTERNAL error, and hides the receiver's status; the
        # receiver's abort message is then the better account of the cause.
        err.echo = code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)
        return err
    return PeerError(f"{what}: rank {dst} at {address}: {exc!r}", peer=dst, peer_address=address)


# --------------------------------------------------------------------- grpc


async def _serve_ping(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return b""


async def _abort_with(context: grpc.aio.ServicerContext[Any, Any], exc: FerroGrpcError) -> None:
    """Fail an RPC with ``exc``: its class and culprit travel as trailing
    metadata, so the sender raises the same kind of error about the same rank."""
    code = (
        grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(exc, ProtocolError)
        else grpc.StatusCode.ABORTED
    )
    context.set_trailing_metadata(
        (
            (ERROR_KEY, type(exc).__name__),
            (CULPRIT_KEY, str(exc.peer if exc.peer is not None else -1)),
        )
    )
    await context.abort(code, str(exc))


def _identity(data: bytes) -> bytes:
    return data


class _GrpcOutStream:
    def __init__(
        self, call: Any, dst: int, address: str, hook: Callable[[int, bytes], bytes] | None
    ) -> None:
        # Keep the call referenced: a collected call is cancelled.
        self._call = call
        self._dst = dst
        self._address = address
        self._hook = hook

    async def write(self, message: bytes) -> None:
        if self._hook is not None:
            message = self._hook(self._dst, message)
        try:
            await self._call.write(message)
        except Exception as exc:
            raise await self._failure(exc) from exc

    async def close(self) -> None:
        try:
            await self._call.done_writing()
            await self._call
        except Exception as exc:
            raise await self._failure(exc) from exc

    async def _failure(self, exc: BaseException) -> FerroGrpcError:
        # A failed write only says "the stream is gone"; the status says why.
        cause: BaseException = exc
        try:
            await asyncio.wait_for(self._call, timeout=1.0)
        except grpc.aio.AioRpcError as status:
            cause = status
        except Exception:
            pass
        return _peer_error(cause, self._dst, self._address, "sending")

    def cancel(self) -> None:
        self._call.cancel()


class _GrpcInStream:
    def __init__(self, iterator: AsyncIterator[bytes]) -> None:
        self._iterator = iterator

    async def read(self) -> bytes | None:
        try:
            return await self._iterator.__anext__()
        except StopAsyncIteration:
            return None


TOKEN_METADATA_KEY = "x-ferrogrpc-token"


class _TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses, with UNAUTHENTICATED, every RPC that does not carry the shared
    token. It runs before any handler, so nothing such a client sends is read."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def deny_unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong ferrogrpc token")
            return b""

        async def deny_stream(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
        ) -> bytes:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong ferrogrpc token")
            return b""

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else bytes(value)
        if hmac.compare_digest(presented, self._token):
            return await continuation(details)
        return self._deny_stream if str(details.method).endswith("/Send") else self._deny_unary


SendHook = Callable[[int, bytes], bytes]


class GrpcTransport(Transport):
    """Chunks over grpc.aio: a client-streaming ``Send`` RPC per (collective,
    lane), on one channel (one TCP connection) per lane, with raw-bytes
    (de)serializers so the bulk path builds no protobuf objects.

    ``tls`` turns on mutual TLS (both sides present certificates signed by
    the given root); ``token`` makes the server refuse any RPC without it and
    the client send it on every RPC. ``send_hook(dst, message)`` may rewrite
    outgoing messages (fault injection in tests)."""

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        *,
        max_message_bytes: int = 80 << 20,
        tls: TLSConfig | None = None,
        token: str | None = None,
        send_hook: SendHook | None = None,
    ) -> None:
        self._bind = bind
        self._advertise_host = advertise_host
        self._max = max_message_bytes
        self._tls = tls
        self._metadata: tuple[tuple[str, str], ...] = (
            ((TOKEN_METADATA_KEY, token),) if token else ()
        )
        self._interceptors = [_TokenInterceptor(token)] if token else []
        self.send_hook = send_hook
        self._server: grpc.aio.Server | None = None
        self._channels: dict[tuple[int, int], grpc.aio.Channel] = {}
        self._handler: StreamHandler | None = None
        self.addresses = []
        self.port = 0

    def _options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_receive_message_length", self._max),
            ("grpc.max_send_message_length", self._max),
            ("grpc.so_reuseport", 0),
        ]

    async def start(self, handler: StreamHandler) -> str:
        self._handler = handler
        server = grpc.aio.server(options=self._options(), interceptors=self._interceptors)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Send": grpc.stream_unary_rpc_method_handler(self._serve_send),
                        "Abort": grpc.unary_unary_rpc_method_handler(self._serve_abort),
                        "Ping": grpc.unary_unary_rpc_method_handler(_serve_ping),
                    },
                ),
            )
        )
        try:
            if self._tls is not None:
                credentials = grpc.ssl_server_credentials(
                    [(self._tls.private_key, self._tls.certificate_chain)],
                    root_certificates=self._tls.root_certificates,
                    require_client_auth=True,
                )
                port = server.add_secure_port(self._bind, credentials)
            else:
                port = server.add_insecure_port(self._bind)
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

    async def _serve_send(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        assert self._handler is not None
        iterator = request_iterator.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty stream")
        try:
            await self._handler.handle_stream(first, _GrpcInStream(iterator), context.peer())
        except FerroGrpcError as exc:
            await _abort_with(context, exc)
        except (ValueError, TypeError, OverflowError, IndexError, KeyError) as exc:
            # Hostile or garbled input that slipped past the checks: a clean
            # error for the client, and this peer goes on serving.
            await _abort_with(context, ProtocolError(f"malformed stream: {exc!r}"))
        return b""

    async def _serve_abort(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        assert self._handler is not None
        try:
            await self._handler.handle_abort(request)
        except FerroGrpcError as exc:
            await _abort_with(context, exc)
        except (ValueError, TypeError, OverflowError, IndexError, KeyError) as exc:
            await _abort_with(context, ProtocolError(f"malformed abort: {exc!r}"))
        return b""

    def _channel(self, dst: int, lane: int) -> grpc.aio.Channel:
        key = (dst, lane)
        channel = self._channels.get(key)
        if channel is None:
            address = self.addresses[dst]
            # A private subchannel pool gives every lane its own TCP connection.
            options = [*self._options(), ("grpc.use_local_subchannel_pool", 1)]
            if self._tls is not None:
                if self._tls.server_name:
                    options.append(("grpc.ssl_target_name_override", self._tls.server_name))
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=self._tls.root_certificates,
                    private_key=self._tls.private_key,
                    certificate_chain=self._tls.certificate_chain,
                )
                channel = grpc.aio.secure_channel(address, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            self._channels[key] = channel
        return channel

    async def open(self, dst: int, lane: int) -> OutStream:
        channel = self._channel(dst, lane)
        method = channel.stream_unary(
            SEND_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        call = method(metadata=self._metadata)  # type: ignore[call-arg]
        return _GrpcOutStream(call, dst, self.addresses[dst], self.send_hook)

    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None:
        method = self._channel(dst, 0).unary_unary(
            ABORT_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            await method(message, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(exc, dst, self.addresses[dst], "abort") from exc

    async def ping(self, dst: int, timeout: float) -> None:
        method = self._channel(dst, 0).unary_unary(
            PING_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            await method(b"", timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise _peer_error(exc, dst, self.addresses[dst], "ping") from exc

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        for channel in channels:
            await channel.close(None)
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace=0.5)
        # Break the peer <-> transport reference cycle so sockets close now,
        # not at the next garbage collection.
        self._handler = None


# ------------------------------------------------------------------- memory


class _MemoryInStream:
    def __init__(self, window: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=window)

    async def read(self) -> bytes | None:
        return await self.queue.get()


class _MemoryOutStream:
    def __init__(
        self, target: MemoryTransport, window: int, dst: int, hook: SendHook | None
    ) -> None:
        self._hook = hook
        self._target = target
        self._window = window
        self._dst = dst
        self._stream: _MemoryInStream | None = None
        self._task: asyncio.Task[None] | None = None

    async def write(self, message: bytes) -> None:
        if self._hook is not None:
            message = self._hook(self._dst, message)
        if self._task is None:
            handler = self._target.handler
            if handler is None or self._target.closed:
                raise PeerError(f"sending: rank {self._dst} is not serving", peer=self._dst)
            self._stream = _MemoryInStream(self._window)
            self._task = asyncio.ensure_future(
                handler.handle_stream(message, self._stream, "memory")
            )
            return
        assert self._stream is not None
        if self._task.done():
            await self._task  # re-raises the receiver's failure
            raise PeerError("sending: receiver finished early", peer=self._dst)
        await self._stream.queue.put(message)

    async def close(self) -> None:
        if self._task is None:
            return
        assert self._stream is not None
        if not self._task.done():
            await self._stream.queue.put(None)
        await self._task

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


class MemoryTransport(Transport):
    """In-process transport: bounded asyncio queues stand in for HTTP/2 streams.
    Peers find each other through a shared registry dict."""

    _ids = itertools.count()

    def __init__(self, registry: dict[str, MemoryTransport], window: int = 4) -> None:
        self._registry = registry
        self._window = window
        self.send_hook: SendHook | None = None
        self.handler: StreamHandler | None = None
        self.closed = False
        # Tests set this to stand for a stopped process: pings go unanswered.
        self.frozen = False
        self.addresses = []

    async def start(self, handler: StreamHandler) -> str:
        self.handler = handler
        address = f"memory:{next(self._ids)}"
        self._registry[address] = self
        return address

    def _target(self, dst: int) -> MemoryTransport:
        target = self._registry.get(self.addresses[dst])
        if target is None:
            err = PeerError(f"rank {dst} is gone", peer=dst, peer_address=self.addresses[dst])
            err.gone = True
            raise err
        return target

    async def open(self, dst: int, lane: int) -> OutStream:
        return _MemoryOutStream(self._target(dst), self._window, dst, self.send_hook)

    async def send_abort(self, dst: int, message: bytes, timeout: float) -> None:
        target = self._target(dst)
        if target.handler is not None and not target.closed:
            await target.handler.handle_abort(message)

    async def ping(self, dst: int, timeout: float) -> None:
        target = self._target(dst)
        if target.closed or target.handler is None:
            err = PeerError(f"rank {dst} is gone", peer=dst)
            err.gone = True
            raise err
        if target.frozen:
            await asyncio.sleep(timeout)
            raise PeerError(f"rank {dst} did not answer a ping", peer=dst)

    async def close(self) -> None:
        self.closed = True
        for address, transport in list(self._registry.items()):
            if transport is self:
                del self._registry[address]
