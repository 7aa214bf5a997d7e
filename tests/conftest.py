from __future__ import annotations

import faulthandler
from collections.abc import Callable

import pytest

faulthandler.enable()

_MEASUREMENTS: list[str] = []


@pytest.fixture
def report() -> Callable[[str], None]:
    """Record a measurement (detection time, throughput...) to print in the
    run's summary, so CI logs show it even when the test passes."""

    def add(line: str) -> None:
        print(line)
        _MEASUREMENTS.append(line)

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _MEASUREMENTS:
        terminalreporter.section("ferrogrpc measurements")
        for line in _MEASUREMENTS:
            terminalreporter.write_line(line)
