"""A rank program for bind-address tests: a group of one joined through
init_backend with the environment's settings; prints ``LISTENING <port>``
(the peer's gRPC port) and stays up until a line arrives on stdin."""

from __future__ import annotations

import sys

import ferrogrpc as fg

backend = fg.init_backend()
print(f"LISTENING {backend.address.rsplit(':', 1)[1]}", flush=True)
sys.stdin.readline()
backend.close()
