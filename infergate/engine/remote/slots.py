"""An endpoint's connection slots, handed out by class and then tenant in turn.

A remote model's requests wait for one of an endpoint's `max_connections` here, not in
the local queue, so this is where a class's priority and a fair share between tenants
must hold, as the queue gives them to a local model: a semaphore served whoever asked
first, and one tenant's 40 requests in flight held another's lone request 10 s (and a
burst one past its deadline) behind them. A free slot goes to the waiting request of the
best class (lowest rank), and within a class to the tenants with requests waiting in
turn, each tenant's own requests first come first served.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Hashable

Turn = tuple[int, Hashable]  # (class rank, tenant): whose turn a waiting request is


class FairSlots:
    def __init__(self, slots: int) -> None:
        self._free = slots
        # Per class rank: the tenants with requests waiting, in turn order, each with its
        # requests' futures in arrival order.
        self._waiting: dict[int, OrderedDict[Hashable, deque[asyncio.Future[None]]]] = {}

    async def acquire(self, turn: Turn = (0, None)) -> None:
        """A slot, once it is this request's turn; `release` it after."""
        if self._free and not self._waiting:
            self._free -= 1
            return
        rank, tenant = turn
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        tenants = self._waiting.setdefault(rank, OrderedDict())
        tenants.setdefault(tenant, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # given the slot as it gave up: the next one's
            else:
                self._forget(rank, tenant, future)
            raise

    def release(self) -> None:
        """A slot back: to the next waiting request whose turn it is, or free."""
        for rank in sorted(self._waiting):
            tenants = self._waiting[rank]
            while tenants:
                tenant, futures = next(iter(tenants.items()))
                future = futures.popleft()
                if futures:
                    tenants.move_to_end(tenant)  # the tenant's next request waits its turn
                else:
                    del tenants[tenant]
                if not tenants:
                    del self._waiting[rank]
                if not future.done():  # (one cancelled, not yet forgotten, is skipped)
                    future.set_result(None)
                    return
        self._free += 1

    def _forget(self, rank: int, tenant: Hashable, future: asyncio.Future[None]) -> None:
        tenants = self._waiting.get(rank)
        futures = tenants.get(tenant) if tenants is not None else None
        if tenants is None or futures is None or future not in futures:
            return  # (`release` took it out already)
        futures.remove(future)
        if not futures:
            del tenants[tenant]
        if not tenants:
            del self._waiting[rank]
