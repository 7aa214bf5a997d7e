"""Exit 0 if the coordinator at HOST:PORT answers grpc.health.v1 SERVING
(for container healthchecks): ``python -m server.health 127.0.0.1:29400``."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = args[0] if args else "127.0.0.1:29400"
    with grpc.insecure_channel(target) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=3
            )
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    raise SystemExit(main())
