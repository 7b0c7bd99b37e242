"""Where the requests of a batch that ended its worker run again (runner.py), on the
in-process fake workers: with tenants named, on the instance the batch ended, once it is
restarted, never on a sibling that serves other tenants (a poison request among them
would end that one too); on any instance once that one fails for good; with no tenant
named, on whichever is free first, as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable

import numpy as np
import pytest

from infergate.engine.scheduling.classes import DEFAULT_CLASSES
from infergate.engine.scheduling.queue import Fairness, QueuePolicy
from infergate.errors import WorkerFailed
from tests.fake_served import Answer, Served
from tests.fake_workers import FakeCall, FakeWorker
from tests.polling import eventually

BATCH = DEFAULT_CLASSES[2]  # its requests wait up to 30 s: through a restart

Sent = asyncio.Task[Answer]


@pytest.fixture
async def two() -> AsyncIterator[Served]:
    policy = QueuePolicy(max_batch_size=4, max_delay_s=0)
    served = await Served(2, policy, backoff_initial_s=0.001).start()
    yield served
    await served.stop()


def send(served: Served, value: float, tenant: Hashable, key: Hashable = "k") -> Sent:
    """A request of one row of `tenant` (None: no tenant named), `x` all `value`, that
    may share a batch (key None: that runs alone)."""
    x = np.full((1, 4), value, np.float32)
    return asyncio.create_task(
        served.scheduler.submit(
            {"x": x}, key, ("y",), BATCH, BATCH.deadline_s, 10.0, None, Fairness(tenant)
        )
    )


async def crashed_batch(
    served: Served, tenants: tuple[Hashable, Hashable]
) -> tuple[Sent, Sent, FakeWorker, FakeWorker]:
    """A good request (x = 1) of the first tenant and a poison one (x = 2) of the second
    run as one batch on one instance, whose worker then crashes, while the other instance
    is free: the two, the crashed worker and the free sibling's."""
    holders = [send(served, 0, tenants[0], key=None) for _ in range(2)]
    first, second = await eventually(
        lambda: len(calls := served.workers.pending()) == 2 and calls,
        what="a call on each instance",
    )
    good, bad = send(served, 1, tenants[0]), send(served, 2, tenants[1])
    await asyncio.sleep(0)
    first.reply()  # the two waiting go as one batch, on the instance it freed
    both = (
        await eventually(
            lambda: [c for c in served.workers.pending() if c is not second],
            what="the two as one batch",
        )
    )[0]
    assert (both.rows, both.worker) == (2, first.worker)
    second.reply()  # the sibling is free, and nothing waits
    await asyncio.gather(*holders)
    both.worker.end("was killed by signal 11")
    return good, bad, both.worker, second.worker


def is_bad(call: FakeCall) -> bool:
    return bool(call.inputs["x"][0, 0] == 2)


async def test_a_crashed_batch_of_tenants_runs_again_only_where_it_crashed(two: Served) -> None:
    """Alice's request and Bob's poison one crash their worker as one batch: each runs
    again alone on that instance once it is restarted. Bob's ends that worker a second
    time and gets the error; Alice's is answered; the sibling, free all along, is never
    sent either and is still up. Before, both went to the free sibling at once, and
    Bob's ended it too."""
    good, bad, crashed, sibling = await crashed_batch(two, ("alice", "bob"))
    for what in ("each again, alone", "the other, alone"):
        call = await two.workers.next_call(what=what)
        assert call.rows == 1
        assert call.worker is two.worker(0 if crashed is two.workers.made[0] else 1)
        assert call.worker not in (crashed, sibling)
        if is_bad(call):
            call.worker.end("was killed by signal 11")
        else:
            call.reply()
    assert (await good)[0]["y"].tolist() == [[1.0] * 4]
    with pytest.raises(WorkerFailed, match="signal 11"):
        await bad
    assert len(sibling.calls) == 1  # its own first request, nothing else
    assert sibling.alive
    assert not two.workers.pending()


async def test_with_no_tenant_named_a_crashed_batch_runs_again_on_a_free_sibling(
    two: Served,
) -> None:
    """Nobody to keep from anybody: the requests of a crashed batch do not wait for its
    restart when a sibling is free."""
    good, bad, crashed, sibling = await crashed_batch(two, (None, None))
    call = await two.workers.next_call(what="one of them again, on the sibling")
    assert call.worker is sibling
    call.reply()
    call = await two.workers.next_call(what="the other")
    assert call.worker is not crashed
    call.reply()
    await asyncio.gather(good, bad)


async def test_work_held_for_an_instance_that_fails_for_good_runs_on_a_sibling(
    two: Served,
) -> None:
    """The crashed instance cannot start a worker again (a bug fails it for good): what
    was to run again there runs on the sibling instead of waiting out its patience."""
    two.workers.start_bug = RuntimeError("a bug in the worker's start")
    good, bad, crashed, sibling = await crashed_batch(two, ("alice", "bob"))
    for _ in range(2):
        call = await two.workers.next_call(what="each on the sibling")
        assert call.worker is sibling
        call.reply()
    await asyncio.gather(good, bad)
    assert "failed" in {i.state for i in two.instances}
