"""Exit 0 if the coordinator at HOST:PORT answers grpc.health.v1 SERVING
(for container healthchecks): ``python -m server.health 127.0.0.1:29400``
(the same program as ``ferrogrpc health``)."""

from __future__ import annotations

import sys

from ferrogrpc.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["health", *sys.argv[1:]]))
