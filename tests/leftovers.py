"""No serial test starts beside processes an earlier test left running, nor leaves any.

The serial tests measure latency against a wall clock: a server, worker, dashboard or
load generator still running from an earlier test takes CPU from the one being measured
(on two cores, one busy leftover is half the machine). So each serial test checks, before
it starts and after its fixtures are torn down, that no process of this test run is alive
that should not be, and kills and names any it finds.

"Of this test run": every process started from here inherits RUN_ENV from this process's
environment (a server's workers, a daemon that detached itself such as a tmux server, an
orphan whose parent died first), so the check finds them however they were reparented,
and never counts another run's processes on a shared machine. What may stay: this
process's descendants that a longer-lived fixture started (a module's server and the
workers it restarts), and, for the check before a test, any of this process's descendants.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker

import psutil
import pytest

RUN_ENV = "INFERGATE_TEST_RUN"
os.environ.setdefault(RUN_ENV, f"{os.getpid()}-{secrets.token_hex(4)}")

GRACE_S = 10.0  # a stopped server's workers exit just after it does: give them time


@dataclass(frozen=True)
class Found:
    pid: int
    top: int | None  # this process's child it descends from; None: not a descendant
    command: str


def _ours() -> list[Found]:
    """The live processes of this test run, this one left out."""
    tag = os.environ[RUN_ENV]
    me = os.getpid()
    # multiprocessing's resource tracker, once a test used shared memory here, lives as
    # long as this process does, by design.
    tracker = resource_tracker._resource_tracker._pid  # type: ignore[attr-defined]
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        info = proc.info
        if info["pid"] in (me, tracker) or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(RUN_ENV) != tag:
                continue
            top = _child_of(proc, me)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone meanwhile, or another user's
        command = " ".join(info["cmdline"] or [])[:160]
        found.append(Found(info["pid"], top, command))
    return found


def _child_of(proc: psutil.Process, ancestor: int) -> int | None:
    """The child of `ancestor` that `proc` descends from (itself included), if any."""
    for parent in [proc, *proc.parents()]:
        if parent.ppid() == ancestor:
            return parent.pid
    return None


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children()}


def _strays(kept: set[int] | None) -> list[Found]:
    """Processes left behind: those not descending from this process (orphans, daemons)
    and, with `kept`, those descending through a child of this one not in `kept`."""
    return [
        found
        for found in _ours()
        if found.top is None or (kept is not None and found.top not in kept)
    ]


def _settled(kept: set[int] | None) -> list[Found]:
    """The strays still there after GRACE_S, killed (so later tests run on a quiet
    machine) and returned."""
    deadline = time.monotonic() + GRACE_S
    strays = _strays(kept)
    while strays and time.monotonic() < deadline:
        time.sleep(0.1)
        strays = _strays(kept)
    for found in strays:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(found.pid).kill()
    return strays


def _describe(strays: list[Found]) -> str:
    return "\n".join(f"  pid {f.pid}: {f.command}" for f in strays)


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """For tests marked serial: see the module docstring. Set up before the test's other
    function-scoped fixtures, torn down after them."""
    if request.node.get_closest_marker("serial") is None:
        yield
        return
    before = _settled(None)
    assert not before, (
        f"processes an earlier test left running (killed now; they would have taken CPU "
        f"from this one):\n{_describe(before)}"
    )
    kept = _children()  # the longer-lived fixtures' processes
    yield
    after = _settled(kept)
    assert not after, (
        f"{request.node.nodeid} left processes running {GRACE_S:g} s after its teardown "
        f"(killed now):\n{_describe(after)}"
    )
