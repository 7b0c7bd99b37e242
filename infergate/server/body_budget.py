"""How many bytes of large request bodies the gateway holds at once (`[server]
max_bodies_mb`).

Every request holds its body from the moment it is read until it is answered (its tensors
may be views of it), and nothing else bounded how many large ones were read at once: with
`[server] fronts`, two fronts hand bodies to the engine faster than one event loop works
through them, and a client sending 2,000 bodies of 1 MB that closed each socket at once
took the engine to 1.5 GB. So a request whose body is larger than the infer lane's (64
KiB) takes its size from this budget before its body is read, and gives it back when it is
answered. One that does not fit waits, unread (its bytes stay in its client's socket, as
one event loop's backlog does in one process), and the tenants whose requests wait take
turns, each its own in arrival order: one tenant's flood delays another's next large
request by at most one of its own, and costs nobody a refusal. A body larger than the
whole budget waits until it is alone."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable

# A body up to this size takes none of the budget (the connection limits bound those): the
# infer lane's largest, uvicorn's HIGH_WATER_LIMIT, below which reading is never paused.
SMALL_BODY = 64 * 1024
DEFAULT_MAX_BODIES_BYTES = 256 << 20  # [server] max_bodies_mb's default


class BodyBudget:
    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.free = limit_bytes
        # tenant -> its waiting requests (size, future), the tenants in turn order
        self._waiting: dict[Hashable, deque[tuple[int, asyncio.Future[None]]]] = {}

    @property
    def held(self) -> int:
        """Bytes taken now."""
        return self.limit - self.free

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return sum(len(queue) for queue in self._waiting.values())

    def share(self, size: int) -> int:
        """What a body of `size` bytes takes: all of it, or all of the budget."""
        return min(size, self.limit)

    async def take(self, tenant: Hashable, size: int) -> None:
        """Wait until `size` bytes (`share`d) are free and this tenant's turn has come;
        the caller must `give` them back."""
        size = self.share(size)
        if not self._waiting and size <= self.free:
            self.free -= size
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant, deque())
        entry = (size, turn)
        queue.append(entry)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give(size)  # given as it gave up: for the next one
            else:
                queue = self._waiting.get(tenant, deque())
                if entry in queue:
                    queue.remove(entry)
                    if not queue:
                        del self._waiting[tenant]
                self._grant()  # it may have been the one the others waited behind
            raise

    def give(self, size: int) -> None:
        self.free += self.share(size)
        self._grant()

    def _grant(self) -> None:
        """Hand out what is free: the tenant first in line goes next, then to the back of
        the line while others wait; the first that does not fit stops the handing out, so
        that a large body is not passed over for ever by small ones."""
        waiting = self._waiting
        while waiting:
            tenant = next(iter(waiting))
            queue = waiting[tenant]
            size, turn = queue[0]
            if size > self.free:
                return
            queue.popleft()
            del waiting[tenant]
            if queue:
                waiting[tenant] = queue  # its next one waits for the others' turns
            if not turn.done():
                self.free -= size
                turn.set_result(None)
