"""``ferrogrpc health HOST:PORT``: exit 0
if the coordinator there answers grpc.health.v1 SERVING, for container
healthchecks. It presents ``FERROGRPC_TOKEN`` and ``FERROGRPC_TLS_*`` as
the coordinator expects them, and imports no torch."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..env import Settings
from ..errors import ConfigError
from ..transport.auth import sync_channel, token_metadata


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ferrogrpc health",
        description="Exit 0 if the coordinator at HOST:PORT answers grpc.health.v1 SERVING "
        "(it presents FERROGRPC_TOKEN and FERROGRPC_TLS_*).",
    )
    parser.add_argument(
        "target",
        metavar="HOST:PORT",
        nargs="?",
        default="127.0.0.1:29400",
        help="the coordinator (default 127.0.0.1:29400)",
    )
    target: str = parser.parse_args(argv).target
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
