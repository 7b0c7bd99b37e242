"""Who loads next (engine/lifecycle/load_slots.py): a restart of a worker that served goes
first, past the limit by a quarter at most; a freed slot goes to a tenant that holds less
than half of them before one that holds more; a waiter that leaves gives its place back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable

from infergate.engine.lifecycle.load_slots import LoadSlots


class Loads:
    """Loads that hold their slot until the test lets them go, in the order they got one."""

    def __init__(self, slots: LoadSlots) -> None:
        self.slots = slots
        self.order: list[str] = []
        self._done: dict[str, asyncio.Event] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, tenant: Hashable, restart: bool = False) -> None:
        self._done[name] = asyncio.Event()
        self.tasks.append(asyncio.create_task(self._load(name, tenant, restart)))

    async def _load(self, name: str, tenant: Hashable, restart: bool) -> None:
        async with self.slots.slot(tenant, restart):
            self.order.append(name)
            await self._done[name].wait()

    async def finish(self, name: str) -> None:
        self._done[name].set()
        await settle()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Loads]:
        try:
            yield self
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_restart_goes_at_once_while_another_tenant_s_loads_hold_every_slot() -> None:
    """Bob's model of 4 instances whose warm-up never ends held every slot until the load
    timeout, and alice's crashed worker waited behind it (19 s down, 8,370 failed
    requests). A restart takes one of a quarter more slots; past those it waits, first in
    line, and a first load waits behind it."""
    slots = LoadSlots(4)
    async with Loads(slots).running() as loads:
        for i in range(4):
            loads.start(f"bob{i}", "bob")
        loads.start("bob-more", "bob")
        await settle()
        loads.start("alice-restart", "alice", restart=True)
        await settle()
        assert loads.order == ["bob0", "bob1", "bob2", "bob3", "alice-restart"]
        assert slots.busy == 5
        loads.start("carol-restart", "carol", restart=True)
        await settle()
        assert "carol-restart" not in loads.order  # the overflow is taken
        await loads.finish("bob0")
        assert loads.order[-1] == "carol-restart"  # first in line, before bob's waiting load
        await loads.finish("alice-restart")
        assert loads.order[-1] == "carol-restart"  # 5 busy: a first load waits for the limit
        await loads.finish("bob1")
        assert loads.order[-1] == "carol-restart"  # bob holds half the slots: his wait
        await loads.finish("bob2")
        assert loads.order[-1] == "bob-more"


async def test_one_tenant_s_restarts_hold_at_most_half_the_slots() -> None:
    """Mallory ended her own 3 workers, whose warm-ups then lasted the load timeout: her
    restarts went first and took the 2 slots and the one more, and a crashed worker of
    another tenant waited 26 s. With several tenants, her restarts hold her share."""
    slots = LoadSlots(2)
    async with Loads(slots).running() as loads:
        loads.start("victim", "victim")  # both tenants' models have loaded
        loads.start("mallory", "mallory")
        await settle()
        await loads.finish("victim")
        await loads.finish("mallory")
        for i in range(3):
            loads.start(f"mallory-restart{i}", "mallory", restart=True)
        await settle()
        assert loads.order[2:] == ["mallory-restart0"]
        loads.start("victim-restart", "victim", restart=True)
        await settle()
        assert loads.order[2:] == ["mallory-restart0", "victim-restart"]
        await loads.finish("mallory-restart0")
        assert loads.order[-1] == "mallory-restart1"


async def test_a_freed_slot_goes_first_to_a_tenant_holding_none() -> None:
    """Mallory's models under two tenants (hers and the default) held both slots, their
    warm-ups lasting the load timeout and their restarts taking each slot freed: the
    victim's new model never loaded. A tenant holding no slot goes first."""
    slots = LoadSlots(2)
    async with Loads(slots).running() as loads:
        loads.start("mal", "mal")
        loads.start("default", "default")
        await settle()
        loads.start("mal-restart", "mal", restart=True)  # each holds its share: it waits
        loads.start("victim-new", "victim")
        await settle()
        assert loads.order == ["mal", "default"]
        await loads.finish("mal")  # its restart, queued first, took the slot back
        assert loads.order[2:] == ["victim-new", "mal-restart"]  # (the one more slot)


async def test_a_freed_slot_goes_to_a_tenant_holding_less_than_half_of_them() -> None:
    slots = LoadSlots(4)
    async with Loads(slots).running() as loads:
        for i in range(6):  # bob alone: 4 at once
            loads.start(f"bob{i}", "bob")
        await settle()
        loads.start("alice", "alice")
        await settle()
        assert loads.order == ["bob0", "bob1", "bob2", "bob3"]
        await loads.finish("bob0")
        assert loads.order[-1] == "alice"  # bob holds 3 of 4: alice's goes first
        await loads.finish("bob1")
        assert loads.order[-1] == "alice"  # bob holds half the slots (alice's loads came)
        await loads.finish("bob2")
        assert loads.order[-1] == "bob4"


async def test_a_waiter_that_leaves_gives_its_place_back() -> None:
    slots = LoadSlots(1)
    async with Loads(slots).running() as loads:
        loads.start("first", "bob")
        await settle()
        waiting = asyncio.create_task(slots.slot("alice").__aenter__())
        await settle()
        loads.start("third", "carol")
        await settle()
        waiting.cancel()
        await settle()
        await loads.finish("first")
        assert loads.order == ["first", "third"]
        assert slots.busy == 1


async def test_a_waiter_cancelled_as_a_slot_is_released_takes_nothing() -> None:
    """A version stopping cancels its instances: the one holding a slot, then the one
    waiting for it, in one tick. The release handed the slot to the cancelled waiter,
    and it was held by nobody for good (after `limit` such stops nothing loaded)."""
    slots = LoadSlots(1)
    async with Loads(slots).running() as loads:
        loads.start("holder", "bob")
        await settle()
        loads.start("waiter", "bob")
        await settle()
        holder, waiter = loads.tasks
        holder.cancel()
        waiter.cancel()
        await settle()
        assert slots.busy == 0
        loads.start("next", "alice")
        await settle()
        assert loads.order == ["holder", "next"]


async def test_with_several_tenants_models_one_holds_at_most_half_the_slots() -> None:
    """Bob's loads whose warm-up never ended held every slot, and alice's new model waited
    for the load timeout. Once models of several tenants have loaded, bob's first loads
    hold half the slots, and alice's load finds one free; one tenant's take them all."""
    slots = LoadSlots(4)
    async with Loads(slots).running() as loads:
        loads.start("alice-earlier", "alice")
        await loads.finish("alice-earlier")
        for i in range(4):
            loads.start(f"bob{i}", "bob")
        await settle()
        assert loads.order == ["alice-earlier", "bob0", "bob1"]
        loads.start("alice", "alice")
        await settle()
        assert loads.order[-1] == "alice"
        await loads.finish("bob0")
        assert loads.order[-1] == "bob2"
