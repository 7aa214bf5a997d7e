"""Which sinks a rank's observer gets: what its settings ask for."""

from __future__ import annotations

from ..env import Settings
from .observer import Observer


def attach(observer: Observer, settings: Settings) -> None:
    """Give ``observer`` the sinks ``settings`` ask for: metrics
    (``metrics_port``) and the trace (``trace_dir``). Nothing when neither
    is set: the flight recorder alone is always on."""
