from __future__ import annotations

import faulthandler
from collections.abc import Callable

import hypothesis  # noqa: F401
import pytest

faulthandler.enable()
# hypothesis is imported here, at collection, on purpose: its pytest plugin
# otherwise imports it in the terminal summary, where pytest's assertion
# rewriting of it hit CPython 3.11.7's "AST constructor recursion depth
# mismatch" SystemError (a run of test_refusal.py with another file passed
# every test and still exited 1).

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
