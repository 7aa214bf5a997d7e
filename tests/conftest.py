from __future__ import annotations

import faulthandler
from collections.abc import Callable
from typing import Any

import hypothesis  # noqa: F401
import pytest

faulthandler.enable()
# hypothesis is imported here, at collection, on purpose: its pytest plugin
# otherwise imports it in the terminal summary, where pytest's assertion
# rewriting of it hit CPython 3.11.7's "AST constructor recursion depth
# mismatch" SystemError (a run of test_refusal.py with another file passed
# every test and still exited 1).


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record a measurement (detection time, throughput...) to print in the
    run's summary, so CI logs show it even when the test passes. It travels
    in the test's report (user_properties), so a pytest-xdist worker's
    measurements reach the summary too."""

    def add(line: str) -> None:
        print(line)
        request.node.user_properties.append(("measurement", line))

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for rep in reports
        if getattr(rep, "when", None) == "call"
        for name, value in getattr(rep, "user_properties", ())
        if name == "measurement"
    ]
    if lines:
        terminalreporter.section("ferrogrpc measurements")
        for line in lines:
            terminalreporter.write_line(str(line))


# Files whose tests share the host's network set-up (network namespaces,
# iptables/nftables rules, Docker's networks) or measure the host as a
# whole: under pytest-xdist they run on one worker, one at a time.
SYSTEM_FILES = {
    "test_compose.py",
    "test_multihost.py",
    "test_slow_link.py",
    "test_link_bench.py",
    "test_train_link_bench.py",
    "test_config.py",
    "test_samehost_admission.py",
}


def system_test(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in SYSTEM_FILES


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadgroup with the SYSTEM_FILES' tests as one group, "system".

    The group is chosen here, by file, rather than with an xdist_group
    marker: pytest-xdist 3.8 names a marked test's group by rewriting its
    node id (``item._nodeid``), which pytest 9.2's structured node ids no
    longer read, so under pytest 9.2 the marker was silently ignored and the
    system tests ran on every worker at once."""
    from xdist.scheduler import LoadGroupScheduling

    class SystemGroup(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return "system" if system_test(nodeid) else str(super()._split_scope(nodeid))

    if config.getvalue("dist") != "loadgroup":
        return None
    return SystemGroup(config, log)
