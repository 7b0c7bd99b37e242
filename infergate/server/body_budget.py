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
request by at most one of its own, and costs nobody a refusal. One tenant holds at most
half of the budget, so that one sending its bodies slowly holds up its own large requests,
not everyone's; the profile keeps max_request_mb within that half. And a tenant that
holds some already takes no more than leaves a quarter free for the tenants that hold
none: one sender with two identities (a key, and anonymous access) held it all."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable

from infergate.errors import Overloaded
from infergate.server.body import body_headers

# A body up to this size takes none of the budget (the connection limits bound those): the
# infer lane's largest, uvicorn's HIGH_WATER_LIMIT, below which reading is never paused.
SMALL_BODY = 64 * 1024
DEFAULT_MAX_BODIES_BYTES = 256 << 20  # [server] max_bodies_mb's default


class BodyBudget:
    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.free = limit_bytes
        # One tenant holds at most half (the profile keeps max_request_mb within it): a
        # tenant whose bodies come slowly (a Content-Length of 64 MB, a byte every few
        # seconds, until body_timeout_s) cannot hold up everyone else's large requests.
        self.tenant_limit = limit_bytes // 2
        # A tenant that holds some already leaves this much free for those that hold none:
        # with half each, a key and anonymous access (two tenants, one sender) held all of
        # it, and every other tenant's large request waited its 10 s for a 503.
        self.reserve = limit_bytes // 4
        self._held_by: dict[Hashable, int] = {}
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
        """What a body of `size` bytes takes: all of it, or a tenant's half of the budget
        (what the profile lets no body be larger than)."""
        return min(size, self.tenant_limit)

    async def room_for_body(
        self, tenant: Hashable, headers: dict[bytes, bytes], limit: int, wait_s: float
    ) -> int:
        """Take room for a body yet to be read, from its headers: its length, or the most
        it may come to (compressed, or of no stated length: `keep_only` once read); none
        for one of `SMALL_BODY` or less, which the connection limits bound already. A
        length or encoding `read_body` refuses is refused here, before any wait. Waits
        at most `wait_s`: past it, 503 with Retry-After (the client's body deadline keeps
        running meanwhile, and a 408 would blame the client for the gateway's backlog).
        Returns the bytes taken, to `give` back."""
        length, encoding = body_headers(headers, limit)
        if encoding in ("gzip", "deflate") or length is None:
            size = self.share(limit)
        elif length > SMALL_BODY:
            size = self.share(length)
        else:
            return 0
        try:
            await asyncio.wait_for(self.take(tenant, size), wait_s)
        except TimeoutError:
            raise Overloaded(
                f"the gateway holds {self.held / 2**20:.0f} MB of large request bodies, its "
                f"[server] max_bodies_mb of {self.limit / 2**20:g} MB or its tenant's half, "
                f"and this one waited {wait_s:g} s for room; retry shortly. Hint: send "
                "smaller batches, or raise max_bodies_mb"
            ) from None
        return size

    def keep_only(self, tenant: Hashable, taken: int, size: int) -> int:
        """Of `taken`, keep what a body read at `size` bytes takes; give back the rest.
        Returns what is kept."""
        kept = self.share(size) if size > SMALL_BODY else 0
        if kept < taken:
            self.give(tenant, taken - kept)
            return kept
        return taken

    def _fits(self, tenant: Hashable, size: int) -> bool:
        return size <= self.free and self._within_own(self._held_by.get(tenant, 0), size)

    def _within_own(self, held: int, size: int) -> bool:
        """Whether a tenant holding `held` may take `size` more, by its own limits: its
        half, and the reserve it leaves to tenants that hold none."""
        if held + size > self.tenant_limit:
            return False
        return not held or self.free - size >= self.reserve

    def _take_now(self, tenant: Hashable, size: int) -> None:
        self.free -= size
        self._held_by[tenant] = self._held_by.get(tenant, 0) + size

    async def take(self, tenant: Hashable, size: int) -> None:
        """Wait until `size` bytes (`share`d) are free for this tenant and its turn has
        come; the caller must `give` them back, for the same tenant."""
        size = self.share(size)
        if not self._waiting and self._fits(tenant, size):
            self._take_now(tenant, size)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant, deque())
        entry = (size, turn)
        queue.append(entry)
        self._grant()  # those ahead may all be at their own limits
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give(tenant, size)  # given as it gave up: for the next one
            else:
                queue = self._waiting.get(tenant, deque())
                if entry in queue:
                    queue.remove(entry)
                    if not queue:
                        del self._waiting[tenant]
                self._grant()  # it may have been the one the others waited behind
            raise

    def give(self, tenant: Hashable, size: int) -> None:
        size = self.share(size)
        self.free += size
        left = self._held_by.get(tenant, 0) - size
        if left > 0:
            self._held_by[tenant] = left
        else:
            self._held_by.pop(tenant, None)
        self._grant()

    def _grant(self) -> None:
        """Hand out what is free, the tenants in turn: the first in line whose next body
        fits goes, then to the back of the line while others wait. A tenant at its own
        limit is passed over and keeps its place (it waits for its own bodies, not for the
        others'); one whose body does not fit in what is free stops the handing out, so
        that a large body is not passed over for ever by small ones."""
        waiting = self._waiting
        progress = True
        while progress and waiting:
            progress = False
            for tenant in list(waiting):
                queue = waiting[tenant]
                size, turn = queue[0]
                if size > self.free:
                    if self._held_by.get(tenant, 0) + size > self.tenant_limit:
                        continue  # at its own limit: it waits for its own bodies
                    return
                if not self._within_own(self._held_by.get(tenant, 0), size):
                    continue
                queue.popleft()
                del waiting[tenant]
                if queue:
                    waiting[tenant] = queue  # its next one waits for the others' turns
                if not turn.done():
                    self._take_now(tenant, size)
                    turn.set_result(None)
                progress = True
