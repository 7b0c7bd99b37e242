"""Tenant isolation's rules as in-process logic, on an injected clock or in this process:
the queue sheds the tenant holding most of it, and the decoding helper takes tenants in
turn (the breaker's tenant rules: tests/test_breaker_tenants.py). tests/test_tenant_isolation.py
holds the same promises end to end, on one real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import Fairness, Job, JobQueue, QueueFull, QueuePolicy
from infergate.server.decoding import BodyDecoder
from tests.polling import eventually
from tests.scripted_runtime import scripted_inputs, wait_while


def test_a_full_queue_sheds_the_tenant_that_holds_most_of_it_never_its_equal() -> None:
    patient = PriorityClass("patient", 0, 60.0)
    queue: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=0, max_queue_size=4))

    def job(name: str, tenant: str, weight: float = 1.0) -> list[Job[str]]:
        return [Job(name, patient, 0.0, 60.0, fair=Fairness(tenant, weight))]

    for i in range(4):
        queue.admit(job(f"b{i}", "bob"))
    assert [v.payload for v in queue.admit(job("a0", "alice"))] == ["b3"]  # bob's last
    assert [v.payload for v in queue.admit(job("a1", "alice"))] == ["b2"]
    with pytest.raises(QueueFull):  # two each: neither sheds the other
        queue.admit(job("a2", "alice"))
    with pytest.raises(QueueFull):
        queue.admit(job("b4", "bob"))
    # A tenant of weight 3 holds three places for each of a tenant of weight 1.
    weighted: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=0, max_queue_size=4))
    for i in range(4):
        weighted.admit(job(f"b{i}", "bob"))
    shed = [v.payload for i in range(3) for v in weighted.admit(job(f"c{i}", "carol", 3.0))]
    assert shed == ["b3", "b2", "b1"]
    with pytest.raises(QueueFull):
        weighted.admit(job("c3", "carol", 3.0))


def held_until(release: str) -> None:
    """Run in the decoding helper: it decodes nothing else until the test writes `release`."""
    wait_while(lambda: not Path(release).exists())


async def test_a_body_whose_client_gives_up_ends_its_turn_with_its_decoding(
    tmp_path: Path,
) -> None:
    """A caller cancelled while it waits for its turn, or while the helper decodes its
    body, leaves the turns as they were: the next body is decoded once that is done."""
    body = orjson.dumps(scripted_inputs(rows=2))
    decoder = BodyDecoder(inline_max_bytes=16)
    release = tmp_path / "release"
    try:
        await decoder.decode(body, None, None, "bob")  # the helper is up
        pool = decoder._helper()
        # The helper held, whatever the machine's speed: the first body stays in it.
        held = asyncio.wrap_future(pool.submit(held_until, str(release)))
        first = asyncio.create_task(decoder.decode(body, None, None, "bob"))
        waiting = asyncio.create_task(decoder.decode(body, None, None, "bob"))
        await eventually(
            lambda: len(pool._pending_work_items) >= 2, what="the first body in the helper"
        )
        waiting.cancel()
        first.cancel()
        for task in (first, waiting):
            with pytest.raises(asyncio.CancelledError):
                await task
        release.touch()
        await asyncio.wait_for(held, 30)
        decoded = await asyncio.wait_for(decoder.decode(body, None, None, "alice"), 30)
        assert decoded.inputs["x"].shape == (2, 4)
    finally:
        release.touch()
        decoder.close()


async def test_bs_large_bodies_do_not_hold_up_as_in_the_decoder() -> None:
    """B sends six large JSON bodies at once, then A one: the helper process that decodes
    large bodies takes the tenants in turn, so A's is decoded right after the one in hand,
    not after B's whole backlog (before: first in, first out, however many B sent)."""
    body = orjson.dumps(scripted_inputs(rows=64))
    decoder = BodyDecoder(inline_max_bytes=16)  # every body counts as large
    done: list[str] = []

    async def decode(tenant: str) -> None:
        decoded = await decoder.decode(body, None, None, tenant)
        assert decoded.inputs["x"].shape == (64, 4)
        done.append(tenant)

    try:
        await asyncio.gather(*(decode("bob") for _ in range(6)), decode("alice"))
    finally:
        decoder.close()
    assert done.index("alice") <= 1, done
