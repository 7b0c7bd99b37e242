"""Where the requests of a batch that ended its worker run again (runner.py), on the
in-process fake workers: with tenants named, on the instance the batch ended, once it is
restarted, not on a sibling that serves other tenants (a poison request among them would
end that one too), until the request that ends it again is found; on any instance when
they cannot wait for the restart or the instance fails for good; with no tenant named, on
whichever is free first, as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from typing import NamedTuple

import numpy as np
import pytest

from infergate.engine.scheduling.classes import DEFAULT_CLASSES, PriorityClass
from infergate.engine.scheduling.queue import Fairness, QueuePolicy
from infergate.errors import WorkerFailed
from tests.fake_served import Answer, Served
from tests.fake_workers import FakeCall, FakeWorker
from tests.polling import eventually

BURST, BATCH = DEFAULT_CLASSES[1:]  # requests that wait up to 200 ms, and up to 30 s

Sent = asyncio.Task[Answer]


POLICY = QueuePolicy(max_batch_size=4, max_delay_s=0)


@pytest.fixture
async def two() -> AsyncIterator[Served]:
    """Two instances whose workers restart at once (a millisecond's backoff)."""
    served = await Served(2, POLICY, backoff_initial_s=0.001).start()
    yield served
    await served.stop()


@pytest.fixture
async def two_slow() -> AsyncIterator[Served]:
    """Two instances whose workers restart after about a second: longer than a burst
    request waits."""
    served = await Served(2, POLICY, backoff_initial_s=1.0).start()
    yield served
    await served.stop()


def send(
    served: Served, value: float, tenant: Hashable, key: Hashable = "k", cls: PriorityClass = BATCH
) -> Sent:
    """A request of one row of `tenant` (None: no tenant named), `x` all `value`, that
    may share a batch (key None: that runs alone)."""
    x = np.full((1, 4), value, np.float32)
    return asyncio.create_task(
        served.scheduler.submit(
            {"x": x}, key, ("y",), cls, cls.deadline_s, 10.0, None, Fairness(tenant)
        )
    )


class Crashed(NamedTuple):
    good: Sent  # x = 1
    bad: Sent  # x = 2: it ends a worker again, alone
    ended: int  # the instance whose worker the batch ended
    sibling: FakeWorker  # the other instance's worker, free when the batch ended


async def crashed_batch(
    served: Served,
    good_of: Hashable,
    bad_of: Hashable,
    holders_of: Hashable = "carol",
    cls: PriorityClass = BATCH,
) -> Crashed:
    """A good request of `good_of` and a poison one of `bad_of` run as one batch on one
    instance, whose worker then crashes, while the other instance is free (it and the
    first served `holders_of`). Of the two, the one whose tenant had the fewest rows
    served runs first again (fair queuing), the good one when they had as many."""
    holders = [send(served, 0, holders_of, key=None, cls=cls) for _ in range(2)]
    first, second = await eventually(
        lambda: len(calls := served.workers.pending()) == 2 and calls,
        what="a call on each instance",
    )
    good, bad = send(served, 1, good_of, cls=cls), send(served, 2, bad_of, cls=cls)
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
    index = next(i for i, instance in enumerate(served.instances) if instance.handle is both.worker)
    both.worker.end("was killed by signal 11")
    return Crashed(good, bad, index, second.worker)


def is_bad(call: FakeCall) -> bool:
    return bool(call.inputs["x"][0, 0] == 2)


async def test_a_crashed_batch_of_tenants_runs_again_where_it_crashed(two: Served) -> None:
    """Alice's request and Bob's poison one crash their worker as one batch: each runs
    again alone on that instance once it is restarted, Alice's first. Bob's ends that
    worker a second time and gets the error; Alice's is answered; the sibling, free all
    along, is sent neither and is still up. Before, both went to the free sibling at
    once, and Bob's ended it too."""
    crashed = await crashed_batch(two, "alice", "bob")
    for what in ("Alice's, alone", "Bob's, alone"):
        call = await two.workers.next_call(what=what)
        assert call.rows == 1
        assert call.worker is two.worker(crashed.ended)  # restarted
        assert is_bad(call) == (what == "Bob's, alone")
        if is_bad(call):
            call.worker.end("was killed by signal 11")
        else:
            call.reply()
    assert (await crashed.good)[0]["y"].tolist() == [[1.0] * 4]
    with pytest.raises(WorkerFailed, match="signal 11"):
        await crashed.bad
    assert len(crashed.sibling.calls) == 1  # the first request it served, nothing else
    assert crashed.sibling.alive
    assert not two.workers.pending()


async def test_once_the_request_that_ends_it_is_found_the_others_take_a_sibling(
    two: Served,
) -> None:
    """As above, Bob's first (Alice had more served before): Bob's ends the restarted
    worker again, alone, and Alice's, found not to be the one, need not wait for a
    second restart: it runs on the free sibling."""
    crashed = await crashed_batch(two, "alice", "bob", holders_of="alice")
    call = await two.workers.next_call(what="Bob's, alone")
    assert is_bad(call)
    assert call.worker is two.worker(crashed.ended)
    call.worker.end("was killed by signal 11")
    call = await two.workers.next_call(what="Alice's, on the sibling")
    assert call.worker is crashed.sibling
    call.reply()
    assert (await crashed.good)[0]["y"].tolist() == [[1.0] * 4]
    with pytest.raises(WorkerFailed, match="signal 11"):
        await crashed.bad


async def test_requests_that_cannot_wait_for_the_restart_take_a_free_sibling(
    two_slow: Served,
) -> None:
    """Burst requests wait at most 200 ms, and the crashed worker restarts in about a
    second: failing them to spare a worker's restart would be the worse trade, so they
    run on the sibling, as before."""
    crashed = await crashed_batch(two_slow, "alice", "bob", cls=BURST)
    for _ in range(2):
        call = await two_slow.workers.next_call(what="each on the sibling")
        assert call.worker is crashed.sibling
        call.reply()
    await asyncio.gather(crashed.good, crashed.bad)


async def test_with_no_tenant_named_a_crashed_batch_runs_again_on_a_free_sibling(
    two: Served,
) -> None:
    """Nobody to keep from anybody: the requests of a crashed batch do not wait for its
    restart when a sibling is free."""
    crashed = await crashed_batch(two, None, None, holders_of=None)
    call = await two.workers.next_call(what="one of them again, on the sibling")
    assert call.worker is crashed.sibling
    call.reply()
    call = await two.workers.next_call(what="the other")
    call.reply()
    await asyncio.gather(crashed.good, crashed.bad)


async def test_work_held_for_an_instance_that_fails_for_good_runs_on_a_sibling(
    two: Served,
) -> None:
    """The crashed instance cannot start a worker again (a bug fails it for good): what
    was to run again there runs on the sibling instead of waiting out its patience."""
    two.workers.start_bug = RuntimeError("a bug in the worker's start")
    crashed = await crashed_batch(two, "alice", "bob")
    for _ in range(2):
        call = await two.workers.next_call(what="each on the sibling")
        assert call.worker is crashed.sibling
        call.reply()
    await asyncio.gather(crashed.good, crashed.bad)
    assert two.instances[crashed.ended].state == "failed"


async def test_another_request_ending_the_instance_does_not_free_the_held_retries(
    two: Served,
) -> None:
    """While Alice's and Bob's retries wait for their instance, Dave's request (of a
    higher class, so taken first) ends it again alone: that says nothing of which of
    theirs does it, so they keep waiting for it, and Bob's poison still never reaches the
    sibling. Before, any lone death there let them all go anywhere."""
    crashed = await crashed_batch(two, "alice", "bob")
    carol = send(two, 0, "carol", key=None)  # takes the free sibling
    dave = send(two, 5, "dave", key=None, cls=BURST)  # waits, ahead of the batch class
    carols = await two.workers.next_call(what="Carol's on the sibling")
    assert carols.worker is crashed.sibling
    daves = (
        await eventually(
            lambda: [c for c in two.workers.pending() if c is not carols],
            what="Dave's on the restarted worker",
        )
    )[0]
    assert float(daves.inputs["x"][0, 0]) == 5.0
    assert daves.worker is two.worker(crashed.ended)
    daves.worker.end("was killed by signal 11")
    carols.reply()
    await carol
    held = 2  # Alice's and Bob's; Dave's own retry (a lone death: chance) may go anywhere
    while held:
        call = await two.workers.next_call(what="the retries")
        if float(call.inputs["x"][0, 0]) == 5.0:
            call.reply()
            continue
        held -= 1
        assert call.worker is not crashed.sibling
        if is_bad(call):
            call.worker.end("was killed by signal 11")
        else:
            call.reply()
    await dave
    await crashed.good
    with pytest.raises(WorkerFailed):
        await crashed.bad
    assert crashed.sibling.alive
