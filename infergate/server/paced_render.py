"""Answers any client may ask for as often as it likes, rendered once for all who wait and
paced: /metrics (16-20 ms a render with a few hundred series) and every model's
statistics (12 ms with many models). Four clients asking in a loop kept a renderer busy
all the time, and every tenant's requests waited behind it (their p99 13-28 ms).

Each answer is rendered after it was asked for, so that a client that acts and then reads
sees what it did; those who ask while a render waits to start share it; and a render
starts no sooner after the one before than the time that one took, times
`(1 - busy_share) / busy_share`, so rendering takes at most `busy_share` of the time
however many ask (at most MAX_REST_S). A lone scrape of a small server waits for nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from infergate.clock import Clock, MonotonicClock

T = TypeVar("T")

BUSY_SHARE = 0.25
# The longest pause between renders: a render's time includes waits that are not its work
# (a slow NVML sample for /metrics), and Prometheus gives up on a scrape after 10 s.
MAX_REST_S = 1.0


class PacedRender(Generic[T]):
    def __init__(
        self,
        render: Callable[[], Awaitable[T]],
        busy_share: float = BUSY_SHARE,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._render = render
        self._rest_per_busy = (1 - busy_share) / busy_share
        self._clock = clock or MonotonicClock()
        self._sleep = sleep
        self._next: asyncio.Future[T] | None = None  # the render not started yet
        self._starting: asyncio.Task[None] | None = None
        self._not_before = float("-inf")

    async def get(self) -> T:
        """A render that starts after this call, shared with whoever else waits for it."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._next.add_done_callback(_retrieved)
            self._starting = asyncio.ensure_future(self._start(self._next, self._starting))
        return await asyncio.shield(self._next)

    async def _start(self, shared: asyncio.Future[T], before: asyncio.Task[None] | None) -> None:
        try:
            if before is not None and not before.done():  # one render at a time
                await asyncio.wait([before])
            wait = self._not_before - self._clock.now()
            if wait > 0:
                await self._sleep(wait)
            self._next = None  # who asks from now on waits for the render after this one
            started = self._clock.now()
            try:
                shared.set_result(await self._render())
            except Exception as exc:
                shared.set_exception(exc)
            finally:
                took = self._clock.now() - started
                rest = min(took * self._rest_per_busy, MAX_REST_S)
                self._not_before = started + took + rest
        except asyncio.CancelledError:  # the gateway stops
            if self._next is shared:
                self._next = None
            shared.cancel()
            raise


def _retrieved(future: asyncio.Future[Any]) -> None:
    # Its askers may all have left: their render's error is not "never retrieved".
    if not future.cancelled():
        future.exception()
