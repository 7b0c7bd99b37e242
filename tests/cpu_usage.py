"""CPU seconds per test file, for finding what makes the suite slow (INFERGATE_TEST_CPU=1).

On a 2-core machine the parallel run is bound by CPU, not by waits, so wall time per test
(`--durations`) points at the wrong tests. Each phase of each test (setup, call, teardown)
is charged the CPU used since the previous phase ended: this process's own
(RUSAGE_SELF) plus that of its children once reaped (RUSAGE_CHILDREN). A server a test
starts is reaped when it stops, and it has reaped its workers, so theirs is included.
The set-up and tear-down of session-scoped fixtures (the shared `server` serves many files,
and its CPU is counted when it is reaped at the end) are a row of their own, not charged
to the file that happened to come first or last. Under pytest-xdist each worker measures
its own tests and the figures ride on the test reports to the controller, which prints
the table.
"""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest

ENV = "INFERGATE_TEST_CPU"
SESSION = "(session-scoped fixtures)"


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuUsage:
    def __init__(self) -> None:
        self._last = self._mark = _cpu_s()
        self._session = 0.0  # session fixtures' CPU inside the phase under way
        self._by_file: defaultdict[str, float] = defaultdict(float)
        self._by_test: defaultdict[str, float] = defaultdict(float)
        self._wall_by_file: defaultdict[str, float] = defaultdict(float)

    def pytest_collection_finish(self) -> None:
        self._last = _cpu_s()  # collection is nobody's test

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Generator[None]:
        before = _cpu_s()
        yield
        if fixturedef.scope == "session":
            self._session += _cpu_s() - before

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        # Fixtures are torn down innermost first: since the last mark, this one's finalizer.
        now = _cpu_s()
        if fixturedef.scope == "session":
            self._session += now - self._mark
        self._mark = now

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self) -> Generator[None]:
        self._mark = _cpu_s()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self) -> Generator[None, pytest.TestReport, None]:
        outcome = yield
        now = _cpu_s()
        report = outcome.get_result()
        report.cpu_s = now - self._last - self._session
        report.session_cpu_s = self._session
        self._last, self._session = now, 0.0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        used = getattr(report, "cpu_s", 0.0)
        self._by_file[report.nodeid.split("::")[0]] += used
        self._wall_by_file[report.nodeid.split("::")[0]] += report.duration
        self._by_test[report.nodeid] += used
        self._by_file[SESSION] += getattr(report, "session_cpu_s", 0.0)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        total = sum(self._by_file.values())
        terminalreporter.write_sep("=", f"CPU seconds by test file ({total:.0f} s in all)")
        terminalreporter.write_line("     CPU     wall  (wall: what LONGEST_FIRST orders by)")
        for name, used in sorted(self._by_file.items(), key=lambda kv: -kv[1]):
            wall = self._wall_by_file.get(name, 0.0)
            terminalreporter.write_line(f"{used:8.1f} {wall:8.1f}  {name}")
        terminalreporter.write_sep("-", "the 25 tests that used most CPU")
        for name, used in sorted(self._by_test.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.write_line(f"{used:8.1f}  {name}")
