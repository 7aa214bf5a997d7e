"""A checkout's ``python -m server.health 127.0.0.1:29400``: the same program
as ``ferrogrpc health`` (which a pip install provides; the docs name that
one): exit 0 if the coordinator at HOST:PORT answers grpc.health.v1 SERVING."""

from __future__ import annotations

import sys

from ferrogrpc.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["health", *sys.argv[1:]]))
