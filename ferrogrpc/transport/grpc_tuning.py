"""gRPC's read path, tuned for streams of large messages
([Note: gRPC's read wake-ups]).

[Note: gRPC's read wake-ups]
On a link slower than the CPU, grpcio's reader wakes for every few
packets that arrive: over 100 Mbit/s a 24 MB all_reduce at world 2 cost
each rank 0.6-0.7 s of CPU (gloo: 0.16-0.2 s), a third of a core for the
whole transfer, taken from the training loop (docs/benchmarks-history.md,
"gRPC's read tuning"). Two of grpc core's experiments remove that: ``tcp_frame_size_tuning``
tells the endpoint how many bytes the message being read still lacks, and
``tcp_rcv_lowat`` sets the socket's SO_RCVLOWAT to them, so the reader wakes
once a message (a chunk, here) has arrived, not per packet. Together they
cut that all_reduce to 0.1-0.13 s of CPU with the same wall time; either
alone changes nothing.

grpc core reads its experiments once, from ``GRPC_EXPERIMENTS``, while the
``grpc`` package loads. So ``import ferrogrpc`` arms a one-shot import hook
(import_hook.py): when ``grpc`` is first imported, in this process, its
loading runs with ``GRPC_EXPERIMENTS`` set (with ``os.putenv`` only) and the
variable is restored at once after, so child processes do not inherit it
(bar one another thread starts in those 0.1 s) and ``os.environ`` never
shows it. The experiments then hold for every gRPC channel and server of
the process, a user's own too. What is applied:

- nothing with ``FERROGRPC_GRPC_TUNING=0`` (or a value that is neither
  on nor off);
- nothing when ``grpc`` was imported before ferrogrpc (import ferrogrpc
  first, or set ``GRPC_EXPERIMENTS`` yourself);
- nothing with a grpcio outside :data:`KNOWN_IN`, the releases measured
  (grpc core logs an error for an experiment name it does not know);
- a ``GRPC_EXPERIMENTS`` of your own is kept, ours appended, unless it
  names either experiment (enabled or, with ``-``, disabled): then it is
  left exactly as it is.

:func:`state` says which happened.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Final

from ..import_hook import around_first_import

EXPERIMENTS_ENV: Final = "GRPC_EXPERIMENTS"
# Read here, not in env.py: env.py loads the checksums (0.1 s), and this
# runs at ``import ferrogrpc``.
TUNING_ENV: Final = "FERROGRPC_GRPC_TUNING"
EXPERIMENTS: Final = ("tcp_frame_size_tuning", "tcp_rcv_lowat")
# The grpcio releases (major, minor) measured with both experiments, from
# the floor in pyproject.toml: grpc core drops an experiment's name once it
# graduates, and then logs "Unknown experiment" for it at every start.
KNOWN_IN: Final = ((1, 85), (1, 86))
_OFF: Final = ("0", "false", "no", "off")
_ON: Final = ("", "1", "true", "yes", "on")

_state = "waiting: grpc has not been imported yet"


def experiments_value(user: str | None) -> str | None:
    """The ``GRPC_EXPERIMENTS`` grpc should load with, given the user's own
    value; None to leave it as it is."""
    names = [n.strip() for n in (user or "").split(",") if n.strip()]
    if any(n.lstrip("-") in EXPERIMENTS for n in names):
        return None
    return ",".join([*names, *EXPERIMENTS])


def grpcio_release() -> tuple[int, int] | None:
    """The installed grpcio's (major, minor), without importing it."""
    import importlib.metadata  # (here: 50 ms, only as grpc loads)

    try:
        parts = str(importlib.metadata.version("grpcio")).split(".")
        return int(parts[0]), int(parts[1])
    except (importlib.metadata.PackageNotFoundError, IndexError, ValueError):
        return None


def _decide(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The value to load grpc with (None: none), and the state to report."""
    setting = environ.get(TUNING_ENV, "").strip().lower()
    if setting in _OFF:
        return None, f"off: {TUNING_ENV}={environ[TUNING_ENV]}"
    if setting not in _ON:
        return None, (
            f"not applied: {TUNING_ENV}={environ[TUNING_ENV]!r} is neither on (1) nor off (0)"
        )
    release = grpcio_release()
    low, high = KNOWN_IN
    if release is None or not low <= release < high:
        return None, (
            f"not applied: grpcio {release} is not a release measured with "
            f"{', '.join(EXPERIMENTS)} ({low} up to {high}, not included); set "
            f"{EXPERIMENTS_ENV} yourself to try them"
        )
    user = environ.get(EXPERIMENTS_ENV)
    value = experiments_value(user)
    if value is None:
        return None, f"left to you: {EXPERIMENTS_ENV}={user} names them"
    return value, f"applied: grpc loaded with {EXPERIMENTS_ENV}={value}"


@contextlib.contextmanager
def _while_grpc_loads() -> Iterator[None]:
    global _state
    try:
        value, said = _decide(os.environ)
    except Exception as exc:  # never the reason grpc does not import
        value, said = None, f"not applied: {exc!r}"
    if value is None:
        _state = said
        yield
        return
    user = os.environ.get(EXPERIMENTS_ENV)
    os.putenv(EXPERIMENTS_ENV, value)
    _state = "failed: grpc did not load"
    try:
        yield
        _state = said
    finally:
        if user is None:
            os.unsetenv(EXPERIMENTS_ENV)
        else:
            os.putenv(EXPERIMENTS_ENV, user)


def tune_when_grpc_loads() -> None:
    """Arm the hook (at ``import ferrogrpc``); see the Note above."""
    global _state
    if not around_first_import("grpc", _while_grpc_loads) and _state.startswith("waiting"):
        user = os.environ.get(EXPERIMENTS_ENV)
        _state = "not applied: grpc was imported before ferrogrpc" + (
            f" (it loaded with your {EXPERIMENTS_ENV}={user})" if user is not None else ""
        )


def state() -> str:
    """What the tuning did in this process, in words."""
    return _state
