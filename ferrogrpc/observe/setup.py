"""Which sinks a rank's observer gets: what its settings ask for."""

from __future__ import annotations

import logging

from ..env import FLIGHT_DIR_ENV, TRACE_ENV, Settings
from ..errors import ConfigError
from . import files, logs, metrics, trace
from .observer import Observer


def check(settings: Settings) -> None:
    """Refuse, before a rank binds or joins anything, directories its
    observer would write into that are not safe for it (ConfigError naming
    the directory and why: another user's, or writable by every user
    without the sticky bit; see [Note: files in a shared directory] in
    files.py). A directory not made yet passes: it is checked when made."""
    try:
        if settings.trace_dir:
            files.check_directory(settings.trace_dir, f"{TRACE_ENV}: the directory")
        if settings.flight_dir:
            files.check_directory(settings.flight_dir, f"{FLIGHT_DIR_ENV}: the directory")
    except files.UnsafeDirectoryError as exc:
        raise ConfigError(str(exc)) from None


def attach(observer: Observer, settings: Settings, local_index: int = 0) -> None:
    """Give ``observer`` the sinks ``settings`` ask for: metrics
    (``metrics_port``; ``local_index``, the rank's place on its host, picks
    its port: metrics.attach) and the trace (``trace_dir``). Nothing when
    neither is set: the flight recorder alone is always on. The logs as
    ``FERROGRPC_LOG`` asks, and at DEBUG a line per collective (logs.py).
    Raises ConfigError if the trace's directory is refused (files.py),
    before the metrics server starts."""
    logs.configure_once(settings.log_format, settings.log_level)
    log = logs.for_rank(observer.identity)
    if log.isEnabledFor(logging.DEBUG):
        observer.collective_sinks.append(logs.collective_line(log))
    if settings.trace_dir:
        trace.attach(observer, settings.trace_dir)
    if settings.metrics_port is not None:
        metrics.attach(observer, settings, local_index)
