"""Waiting for observable state instead of sleeping: the verdict is the same on a fast
machine and a busy one; only how long the wait takes changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal, TypeVar

import psutil

T = TypeVar("T")
# Looks come quickly at first, then further apart: a look is often an HTTP request to a
# server, and a suite of tests waiting out breaker windows, TTLs and restarts by looking
# every 20 ms spent a good share of the machine's CPU on looking (more, the busier it was).
MAX_PAUSE_S = 0.1


def wait_until(
    check: Callable[[], T | Literal[False] | None], timeout_s: float = 30.0, what: str = ""
) -> T:
    """`check()`'s first truthy value; AssertionError naming `what` if none comes in time
    (the timeout only bounds a broken run, it is never what a test measures)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what or check}")
        time.sleep(pause)
        pause = min(pause * 1.25, MAX_PAUSE_S)


async def eventually(
    check: Callable[[], T | Literal[False] | None], timeout_s: float = 10.0, what: str = ""
) -> T:
    """wait_until inside an event loop: yields to the loop between looks."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what or check}")
        await asyncio.sleep(pause)
        pause = min(pause * 1.25, MAX_PAUSE_S / 5)


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaps (its parent died, and PID 1 in a
    container may never reap it), which psutil's is_running() still calls running."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
