"""A version's requests in flight, counted so that a drain waits for the last one."""

from __future__ import annotations

import asyncio


class InFlight:
    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        # Counted from the same loop step that chose the version, so a drain never misses
        # a request that is about to start.
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Wait for every request in flight to finish (True), or the timeout (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
