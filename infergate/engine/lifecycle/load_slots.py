"""How many workers load at once, gateway-wide (`[server] max_concurrent_loads`), and who
loads next.

A worker's load takes memory and CPU (a runtime opening its file, a warm-up), so loads
take slots, and the rest wait. Two rules keep one tenant's loads from holding up another
tenant's models:

- A restart of a worker that served (it crashed, or was killed for its memory) goes
  first, and when every slot is taken it may take one of `overflow` more (a quarter of the
  limit, at least one): its model was serving and its callers wait on it. Queued behind
  another tenant's loads, it waited: a tenant deploying a model of 4 instances whose
  warm-up never ended held every slot until the load timeout, and another tenant's
  crashed worker stayed down 19 s (8,370 of its requests failed). Bounded, so that many
  workers dying at once (the kernel's OOM killer) do not all load at once; and held to
  the tenant's share below, so that one tenant's restarts never hold every slot (a
  tenant that ended its own 3 workers, each warming up for the load timeout, held the 2
  slots and the one more, and another tenant's crashed worker waited 26 s).
- Once the models of several tenants have loaded (models.toml's `tenant`), a tenant's
  loads, restarts included, hold at most half the slots (rounded up), so that
  another's always find room: before, a tenant's loads whose warm-up never ended held them
  all, and another tenant's new model waited for the load timeout. A slot freed goes to the
  first waiting load whose tenant holds less than that, and before anything else to a
  tenant that holds none: one sender's models under two tenants (its own and the default)
  held every slot, their restarts taking each one freed, and another tenant's new model
  never loaded. Where every model is one tenant's (the default's, when none names one), its
  loads take every slot.
"""

from __future__ import annotations

import contextlib
from asyncio import Future, get_running_loop
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Waiter:
    tenant: Hashable
    restart: bool
    granted: Future[None] = field(default_factory=lambda: get_running_loop().create_future())


class LoadSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tenants: set[Hashable] = set()  # whose loads it has seen (a model's tenant)
        self.overflow = max(1, limit // 4)  # more, for restarts only
        self._share = max(1, (limit + 1) // 2)
        self._held: dict[Hashable, int] = {}  # per tenant, restarts included
        self.busy = 0
        self._waiting: list[_Waiter] = []

    @contextlib.asynccontextmanager
    async def slot(self, tenant: Hashable, restart: bool = False) -> AsyncIterator[None]:
        """Hold a slot while the block runs (`restart`: of a worker that served)."""
        self._tenants.add(tenant)
        first = restart and not self._capped(tenant)  # goes first, past the limit
        # Ahead of it: a restart waiting that goes first; for another load, any load that
        # could go now (one whose tenant waits for its share is not).
        ahead = any(
            self._goes_first(w) or not (first or self._capped(w.tenant)) for w in self._waiting
        )
        if self._free_for(first) and not ahead and not self._capped(tenant):
            self._take(tenant)
        else:
            waiter = _Waiter(tenant, restart)
            self._waiting.append(waiter)
            try:
                await waiter.granted
            except BaseException:
                if waiter.granted.done() and not waiter.granted.cancelled():
                    self._release(tenant)  # granted as it was cancelled: passed on
                elif waiter in self._waiting:
                    self._waiting.remove(waiter)
                raise
        try:
            yield
        finally:
            self._release(tenant)

    def _free_for(self, restart: bool) -> bool:
        return self.busy < self.limit + (self.overflow if restart else 0)

    def _capped(self, tenant: Hashable) -> bool:
        """Whether `tenant`'s first loads wait for its share (see the module docstring)."""
        return self._held.get(tenant, 0) >= self._share and self._several()

    def _goes_first(self, waiter: _Waiter) -> bool:
        return waiter.restart and not self._capped(waiter.tenant)

    def _several(self) -> bool:
        return len(self._tenants) > 1

    def _take(self, tenant: Hashable) -> None:
        self.busy += 1
        self._held[tenant] = self._held.get(tenant, 0) + 1

    def _release(self, tenant: Hashable) -> None:
        self.busy -= 1
        left = self._held[tenant] - 1
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]
        while (waiter := self._next(tenant)) is not None:
            self._waiting.remove(waiter)
            self._take(waiter.tenant)
            waiter.granted.set_result(None)

    def _next(self, released_by: Hashable) -> _Waiter | None:
        """The waiter a free slot goes to now, if any (see the module docstring)."""
        # A waiter cancelled in the tick of a release is still listed until its task runs:
        # the slot is not its (given, it would be held by nobody for good).
        self._waiting = [w for w in self._waiting if not w.granted.done()]
        if self._several():  # a tenant holding no slot first: see the module docstring
            empty = [w for w in self._waiting if not self._held.get(w.tenant)]
            # Another tenant's before the one whose load just ended (its next restart, queued
            # first, took back each slot it freed).
            other = next((w for w in empty if w.tenant != released_by), None)
            first = other or next(iter(empty), None)
            if first is not None and self._free_for(self._goes_first(first)):
                return first
        restart = next((w for w in self._waiting if self._goes_first(w)), None)
        if restart is not None:
            return restart if self._free_for(True) else None
        if not self._waiting or not self._free_for(False):
            return None
        fair = (w for w in self._waiting if self._held.get(w.tenant, 0) < self._share)
        return next(fair, None if self._several() else self._waiting[0])
