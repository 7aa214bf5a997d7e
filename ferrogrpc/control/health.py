"""``ferrogrpc health HOST:PORT`` (and ``python -m server.health``): exit 0
if the coordinator there answers grpc.health.v1 SERVING, for container
healthchecks. It presents ``FERROGRPC_TOKEN`` and ``FERROGRPC_TLS_*`` as
the coordinator expects them, and imports no torch."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..env import Settings
from ..errors import ConfigError
from ..transport.auth import sync_channel, token_metadata


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = args[0] if args else "127.0.0.1:29400"
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"{target}: {exc}", file=sys.stderr)
        return 1
    with sync_channel(target, settings.tls) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=3,
                metadata=token_metadata(settings.token),
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            print(f"{target}: {code.name if code else exc}", file=sys.stderr)
            return 1
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
    return 0 if serving else 1
