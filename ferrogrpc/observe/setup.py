"""Which sinks a rank's observer gets: what its settings ask for."""

from __future__ import annotations

import logging

from ..env import Settings
from . import logs, metrics, trace
from .observer import Observer


def attach(observer: Observer, settings: Settings, local_index: int = 0) -> None:
    """Give ``observer`` the sinks ``settings`` ask for: metrics
    (``metrics_port``; ``local_index``, the rank's place on its host, picks
    its port: metrics.attach) and the trace (``trace_dir``). Nothing when
    neither is set: the flight recorder alone is always on. The logs as
    ``FERROGRPC_LOG`` asks, and at DEBUG a line per collective (logs.py)."""
    logs.configure_once(settings.log_format, settings.log_level)
    log = logs.for_rank(observer.identity)
    if log.isEnabledFor(logging.DEBUG):
        observer.collective_sinks.append(logs.collective_line(log))
    if settings.metrics_port is not None:
        metrics.attach(observer, settings, local_index)
    if settings.trace_dir:
        trace.attach(observer, settings.trace_dir)
