"""Injected time: logic reads a Clock so tests advance time instead of sleeping."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...


class MonotonicClock:
    # The C function itself, not a method calling it: the engine reads the clock about
    # eight times per request, and a Python frame each time cost more than the read.
    now = staticmethod(time.monotonic)


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds
