"""Authentication for every gRPC server and client ferrogrpc runs: the
shared token (a server interceptor, and the metadata clients send) and
mutual TLS (server and channel credentials). Peers (transport/grpc_streams.py) and
the coordinator (coordinator.py), with its status and healthcheck clients,
use the same pieces, configured by the same settings (``FERROGRPC_TOKEN``,
``FERROGRPC_TLS_*``)."""

from __future__ import annotations

import hmac
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio

from ..options import TLSConfig, check_token

TOKEN_METADATA_KEY = "x-ferrogrpc-token"

Metadata = tuple[tuple[str, str], ...]


def token_metadata(token: str | None) -> Metadata:
    """The metadata a client sends on every call: the token, if any.
    ConfigError for a token gRPC cannot carry (options.check_token)."""
    check_token(token, "token")
    return ((TOKEN_METADATA_KEY, token),) if token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses, with UNAUTHENTICATED, every RPC that does not carry the shared
    token, whatever its method and shape. It runs before any handler: the
    refusal reads nothing the client sent."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        message = "missing or wrong ferrogrpc token"

        async def deny(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            return b""

        async def deny_stream(
            requests: AsyncIterator[object], context: grpc.aio.ServicerContext[Any, Any]
        ) -> bytes:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            return b""

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny_stream),
            (True, True): grpc.stream_stream_rpc_method_handler(deny_stream),
        }

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else bytes(value)
        handler = await continuation(details)  # a lookup: no handler runs yet
        if hmac.compare_digest(presented, self._token):
            return handler
        if handler is None:  # not even which methods exist is told
            return self._deny[(False, False)]
        return self._deny[(bool(handler.request_streaming), bool(handler.response_streaming))]


def interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:  # type: ignore[type-arg]
    """A server's interceptors: the token's, if any (ConfigError for a
    token gRPC cannot carry: options.check_token)."""
    check_token(token, "token")
    return [TokenInterceptor(token)] if token else []


def add_port(server: grpc.aio.Server, bind: str, tls: TLSConfig | None) -> int:
    """Bind ``server`` on ``bind``: with mutual TLS when ``tls`` is given
    (clients must present a certificate chaining to its CA). Returns the
    port, 0 if it could not bind."""
    if tls is None:
        return server.add_insecure_port(bind)
    credentials = grpc.ssl_server_credentials(
        [(tls.private_key, tls.certificate_chain)],
        root_certificates=tls.root_certificates,
        require_client_auth=True,
    )
    return server.add_secure_port(bind, credentials)


def _channel_args(
    tls: TLSConfig | None, options: Sequence[tuple[str, Any]]
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    opts = list(options)
    if tls is None:
        return None, opts
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )
    return credentials, opts


_runtime_kept = False
_runtime_lock = threading.Lock()


def keep_aio_runtime() -> None:
    """Hold grpc.aio's process-wide runtime (its completion queue and poller
    thread) for the rest of the process; call on a running event loop.

    grpc.aio starts the runtime with the first channel or server and shuts
    it down when the last one is freed. That shutdown waits, with no time
    limit, until every operation still queued on the completion queue has
    finished, and the free runs in whatever thread collects the garbage: a
    call torn down mid-flight (a peer killed, a loop closed under it) can
    make that thread wait forever (seen once, in a test process's final
    ``gc.collect()``). Held, the runtime is never shut down: its poller is
    a daemon thread, and each new event loop binds to it as before."""
    global _runtime_kept
    with _runtime_lock:
        if not _runtime_kept:
            grpc.aio.init_grpc_aio()  # type: ignore[attr-defined]  # one reference more, never released
            _runtime_kept = True


def aio_server(
    options: Sequence[tuple[str, Any]], interceptors: Sequence[Any] = ()
) -> grpc.aio.Server:
    """An asyncio server (see :func:`keep_aio_runtime`)."""
    keep_aio_runtime()
    return grpc.aio.server(options=options, interceptors=interceptors)


def aio_channel(
    target: str, tls: TLSConfig | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to ``target``, over mutual TLS when ``tls`` is given
    (see :func:`keep_aio_runtime`)."""
    keep_aio_runtime()
    credentials, opts = _channel_args(tls, options)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=opts)
    return grpc.aio.secure_channel(target, credentials, options=opts)


def sync_channel(
    target: str, tls: TLSConfig | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to ``target``, over mutual TLS when ``tls`` is given."""
    credentials, opts = _channel_args(tls, options)
    if credentials is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, credentials, options=opts)
