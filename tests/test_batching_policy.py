"""When the dynamic batcher holds a part-full batch back, in-process on the FakeClock
through the worker seam: a lone client never waits `max_delay_s`, whatever its requests'
size (holding back only pays when other requests are on their way: while a batch runs,
or the callers of the last ones were just answered), while requests that queue behind a
busy instance still run as one batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from infergate.engine.scheduling.batching import batch_key
from infergate.engine.scheduling.classes import DEFAULT_CLASSES, PriorityClass
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.errors import InfergateError
from tests.fake_served import Answer, Served
from tests.polling import eventually

BATCH = DEFAULT_CLASSES[2]  # a 30 s queue deadline: only the batching delay can hold it


class Batcher(Served):
    """Instances on fake workers, batching up to 8 rows with a 5 ms delay."""

    def __init__(self, instances: int = 1, delay_s: float = 0.005, queue_size: int = 1024) -> None:
        policy = QueuePolicy(max_batch_size=8, max_delay_s=delay_s, max_queue_size=queue_size)
        super().__init__(instances, policy)

    async def send(
        self,
        rows: int,
        cls: PriorityClass = BATCH,
        width: int = 4,
        queue_deadline_s: float | None = None,
    ) -> asyncio.Task[Answer]:
        """A batchable request; returns once the scheduler has admitted it (and sent it,
        when it goes at once): submit does both before its first await."""
        x = np.ones((rows, width), np.float32)
        key = batch_key({"x": x})
        patience = cls.deadline_s if queue_deadline_s is None else queue_deadline_s
        task = asyncio.create_task(
            self.scheduler.submit({"x": x}, key, ("y",), cls, patience, 10.0)
        )
        await asyncio.sleep(0)
        return task


@pytest.fixture
async def batcher() -> AsyncIterator[Batcher]:
    b = await Batcher().start()
    yield b
    await b.stop()


async def test_a_lone_client_sending_two_row_requests_never_waits_the_delay(
    batcher: Batcher,
) -> None:
    start = batcher.clock.now()
    for sent in range(10):  # enough for any average of past batch sizes to settle at 2
        task = await batcher.send(rows=2)
        pending = batcher.workers.pending()
        assert [c.rows for c in pending] == [2], f"request {sent} was held back"
        pending[0].reply()
        outputs, _ = await task
        assert outputs["y"].shape == (2, 4)
    assert batcher.clock.now() == start  # no time passed: nothing waited for a batch to fill


async def test_requests_queued_behind_a_busy_instance_run_as_one_batch(
    batcher: Batcher,
) -> None:
    first = await batcher.send(rows=2)
    running = batcher.workers.pending()
    assert [c.rows for c in running] == [2]
    queued = [await batcher.send(rows=2) for _ in range(3)]  # the instance is busy
    assert len(batcher.workers.pending()) == 1
    running[0].reply()
    await first
    merged = await batcher.workers.next_call("the queued requests' batch")
    assert merged.rows == 6  # the three queued requests, in one run
    merged.reply()
    for task in queued:
        outputs, _ = await task
        assert outputs["y"].shape == (2, 4)


async def _answer_a_batch_of_six(batcher: Batcher) -> list[asyncio.Task[Answer]]:
    """One request alone, then five queued behind it that run as one batch: six callers
    answered, on their way back (the batch of five while nothing else runs)."""
    first = await batcher.send(rows=1)  # alone: at once
    queued = [await batcher.send(rows=1) for _ in range(5)]
    (running,) = batcher.workers.pending()
    running.reply()
    await first
    merged = await batcher.workers.next_call("the queued requests' batch")
    assert merged.rows == 5  # (two callers answered: too few to wait for)
    merged.reply()
    for task in queued:
        await task
    return queued


async def test_callers_just_answered_are_waited_for_instead_of_a_batch_of_one(
    batcher: Batcher,
) -> None:
    """Clients that send their next request once answered: the first to come back after a
    batch is held for the others, not run alone (a batch of one, and the next cut short),
    until as few are awaited as twice the instances; no time passes."""
    await _answer_a_batch_of_six(batcher)
    start = batcher.clock.now()
    back = [await batcher.send(rows=1) for _ in range(3)]
    assert batcher.workers.pending() == []  # held: three more are on their way
    back.append(await batcher.send(rows=1))  # two awaited now: it goes
    (batch,) = batcher.workers.pending()
    assert batch.rows == 4
    assert batcher.clock.now() == start
    batch.reply()
    for task in back:
        outputs, _ = await task
        assert outputs["y"].shape == (1, 4)


async def test_callers_that_do_not_come_back_hold_a_batch_only_their_share_of_the_delay(
    batcher: Batcher,
) -> None:
    """Six callers answered: a request is held for them for at most six eighths of the
    5 ms delay (max_delay_s / max_batch_size each), then goes alone."""
    await _answer_a_batch_of_six(batcher)
    held = await batcher.send(rows=1)
    batcher.clock.advance(0.0035)
    for _ in range(5):  # the scheduler's loop looks, plans its next look, sleeps
        await asyncio.sleep(0)
    assert batcher.workers.pending() == []
    batcher.clock.advance(0.0003)  # 3.8 ms: past 6 x 0.625 ms, within the 5 ms delay
    (alone,) = await eventually(batcher.workers.pending, what="the held request to go")
    assert alone.rows == 1
    alone.reply()
    outputs, _ = await held
    assert outputs["y"].shape == (1, 4)


async def test_once_a_rounds_callers_are_all_back_the_last_go_beside_the_running_batch() -> None:
    """Nine callers answered on two instances: the first five back go as one batch once
    four are awaited (twice the instances), and the last four do not wait beside it for
    its callers (they come back only once it is answered): with the last of them they
    go on the other instance at once, not a round later on the same one."""
    batcher = await Batcher(instances=2).start()
    try:
        first = await batcher.send(rows=1)  # alone: at once
        full = [await batcher.send(rows=1) for _ in range(8)]  # fills the other instance
        for call in batcher.workers.pending():
            call.reply()
        for task in (first, *full):
            await task
        start = batcher.clock.now()
        back = [await batcher.send(rows=1) for _ in range(4)]
        assert batcher.workers.pending() == []  # held for the callers on their way back
        back.append(await batcher.send(rows=1))  # four awaited now: it goes
        assert [c.rows for c in batcher.workers.pending()] == [5]
        last = [await batcher.send(rows=1) for _ in range(3)]
        assert len(batcher.workers.pending()) == 1  # held beside the running batch
        last.append(await batcher.send(rows=1))  # the round's last caller
        assert sorted(c.rows for c in batcher.workers.pending()) == [4, 5]
        assert batcher.clock.now() == start
        for call in batcher.workers.pending():
            call.reply()
        for task in (*back, *last):
            outputs, _ = await task
            assert outputs["y"].shape == (1, 4)
    finally:
        await batcher.stop()


async def test_a_lone_client_sending_a_request_in_chunks_never_waits(batcher: Batcher) -> None:
    """25 rows run as chunks of 8, 8, 8 and 1: each goes as the one before is answered,
    the callers counted once (a request's last chunk), and the rest of a request that
    started never held back to fill."""
    task = await batcher.send(rows=25)
    for rows in (8, 8, 8, 1):
        call = await batcher.workers.next_call(f"the chunk of {rows}")
        assert call.rows == rows
        batcher.clock.advance(0.0003)
        call.reply()
    outputs, _ = await task
    assert outputs["y"].shape == (25, 4)
    newcomer = await batcher.send(rows=1)  # one caller answered, not four: at once
    assert [c.rows for c in batcher.workers.pending()] == [1]
    batcher.workers.pending()[0].reply()
    await newcomer


async def test_the_rest_of_a_lone_request_in_chunks_goes_beside_its_running_chunk() -> None:
    """9 rows on two instances: the chunk of 1 goes beside the running chunk of 8 at once,
    not held to fill (the request already runs: its caller waits on it)."""
    batcher = await Batcher(instances=2).start()
    try:
        task = await batcher.send(rows=9)
        assert sorted(c.rows for c in batcher.workers.pending()) == [1, 8]
        for call in batcher.workers.pending():
            call.reply()
        outputs, _ = await task
        assert outputs["y"].shape == (9, 4)
    finally:
        await batcher.stop()


async def test_requests_of_a_failed_batch_run_again_are_not_awaited_twice(
    batcher: Batcher,
) -> None:
    """A batch of two fails on the model and each of its requests runs again alone: they
    were counted as answered when the failure came, and are not awaited for it once
    queued again. Three callers answered in all, so a newcomer goes at once."""
    first = await batcher.send(rows=1)
    queued = [await batcher.send(rows=1) for _ in range(2)]
    (running,) = batcher.workers.pending()
    running.reply()
    await first
    merged = await batcher.workers.next_call("the queued requests' batch")
    assert merged.rows == 2
    merged.fail()
    for _ in range(2):
        alone = await batcher.workers.next_call("a request run again alone")
        assert alone.rows == 1
        batcher.clock.advance(0.0002)
        alone.reply()
    for task in queued:
        await task
    newcomer = await batcher.send(rows=1)
    assert [c.rows for c in batcher.workers.pending()] == [1]
    batcher.workers.pending()[0].reply()
    await newcomer


async def test_the_rest_of_a_running_request_goes_with_another_waiting_beside_it() -> None:
    """A 9-row request's chunk of 8 runs; its chunk of 1 and another client's request wait:
    they go together once an instance frees, not held for the delay beside the chunk of 8
    (the check of a batch of several jobs, not only a lone one's)."""
    batcher = await Batcher(instances=2).start()
    busy = [await batcher.send(rows=1) for _ in range(9)]  # 1 on one instance, 8 on the other
    try:
        request = await batcher.send(rows=9)  # chunks of 8 and 1: queued
        other = await batcher.send(rows=1)
        one, eight = sorted(batcher.workers.pending(), key=lambda c: c.rows)
        one.reply()  # the request's chunk of 8 (a full batch) goes
        await eventually(lambda: len(batcher.workers.pending()) == 2, what="the chunk of 8")
        eight.reply()  # the other instance frees: the rest goes at once, merged
        for _ in range(5):
            await asyncio.sleep(0)
        assert sorted(c.rows for c in batcher.workers.pending()) == [2, 8]
        for call in batcher.workers.pending():
            call.reply()
        outputs, _ = await request
        assert outputs["y"].shape == (9, 4)
        await other
    finally:
        for task in busy:
            await task
        await batcher.stop()


async def test_while_another_batch_runs_a_free_instance_waits_the_delay_to_fill() -> None:
    batcher = await Batcher(instances=2).start()
    try:
        first = await batcher.send(rows=1)
        assert [c.rows for c in batcher.workers.pending()] == [1]  # alone: at once
        second = await batcher.send(rows=1)  # a batch runs: its callers are coming back
        third = await batcher.send(rows=1)
        assert len(batcher.workers.pending()) == 1  # held on the free instance, filling
        batcher.clock.advance(0.006)  # past max_delay_s
        running, merged = await eventually(
            lambda: len(batcher.workers.pending()) == 2 and batcher.workers.pending(),
            what="the held batch to go",
        )
        assert merged.rows == 2  # the two that arrived meanwhile, in one run
        running.reply()
        merged.reply()
        for task in (first, second, third):
            outputs, _ = await task
            assert outputs["y"].shape == (1, 4)
    finally:
        await batcher.stop()


async def test_requests_that_fill_a_held_batch_make_it_go_at_once() -> None:
    """While a batch runs, a free instance holds back for its batch to fill: the request
    that brings it to max_batch_size rows starts it then, without waiting out the delay
    (a request that queues while a batch fills is not always looked at again: see
    `Scheduler.enqueue`)."""
    batcher = await Batcher(instances=2).start()
    try:
        first = await batcher.send(rows=1)  # alone: at once
        held = [await batcher.send(rows=1) for _ in range(7)]  # 7 of 8 rows: held
        assert len(batcher.workers.pending()) == 1
        held.append(await batcher.send(rows=1))  # the eighth row: the batch is full
        running, full = batcher.workers.pending()
        assert full.rows == 8
        for call in (running, full):
            call.reply()
        for task in (first, *held):
            outputs, _ = await task
            assert outputs["y"].shape == (1, 4)
    finally:
        await batcher.stop()


async def test_a_more_urgent_full_batch_goes_at_once_past_one_held_to_fill() -> None:
    """A batch is held to fill on the free instance when a realtime request arrives that
    fills a batch by itself (another shape: it cannot join the held one): it starts at
    once, ahead of the held batch."""
    batcher = await Batcher(instances=2).start()
    try:
        first = await batcher.send(rows=1)  # alone: at once
        held = await batcher.send(rows=1)  # held on the free instance
        urgent = await batcher.send(rows=8, cls=DEFAULT_CLASSES[0], width=6)
        running, sent = batcher.workers.pending()
        assert sent.rows == 8
        for call in (running, sent):
            call.reply()
        outputs, _ = await urgent
        assert outputs["y"].shape == (8, 6)
        await first
        batcher.clock.advance(0.006)  # the held request goes after the delay
        (late,) = await eventually(batcher.workers.pending, what="the held request to go")
        late.reply()
        outputs, _ = await held
        assert outputs["y"].shape == (1, 4)
    finally:
        await batcher.stop()


async def test_a_late_request_behind_a_held_batch_is_expired_before_it_crowds_out_others() -> None:
    """A request past its queue deadline while a batch is held to fill answers 504 as soon
    as another request comes, not only once the scheduler's loop looks: until then it
    would keep its place in a full queue, and a request that fits would get 503."""
    served = await Batcher(instances=2, delay_s=5.0, queue_size=3).start()
    try:
        first = await served.send(rows=1)  # alone: at once, on one instance
        held = await served.send(rows=1)  # held on the other to fill (for 5 s)
        late = await served.send(rows=1, queue_deadline_s=1.0)  # joins it, 1 s of patience
        for _ in range(5):  # the scheduler's loop looks, plans its next look, sleeps
            await asyncio.sleep(0)
        served.clock.advance(1.5)  # its deadline has passed; the batch still fills
        fits = [await served.send(rows=1), await served.send(rows=1)]
        with pytest.raises(InfergateError) as expired:
            await late
        assert expired.value.status == 504
        assert not any(t.done() for t in fits)  # queued, not refused
        (running,) = served.workers.pending()
        running.reply()
        await first
        merged = await served.workers.next_call("the held batch")
        assert merged.rows == 3  # held, and the two that fit; not the late one
        merged.reply()
        for task in (held, *fits):
            outputs, _ = await task
            assert outputs["y"].shape == (1, 4)
    finally:
        await served.stop()


async def test_a_request_held_to_fill_goes_after_the_delay_when_the_loop_slept_long() -> None:
    """The scheduler's loop is asleep on a long plan (a request pinned to a busy instance,
    its deadline 30 s away) when that request starts and leaves the queue empty; a request
    then held on the free instance to fill its batch still goes once the delay is up."""
    batcher = await Batcher(instances=2).start()
    try:
        first = await batcher.send(rows=1)  # alone: at once, on instance 0
        x = np.ones((1, 4), np.float32)
        pinned = asyncio.create_task(
            batcher.scheduler.submit(
                {"x": x}, batch_key({"x": x}), ("y",), BATCH, BATCH.deadline_s, 10.0, instance=0
            )
        )
        for _ in range(10):  # queued behind instance 0; the loop wakes and plans for its
            await asyncio.sleep(0)  # deadline (a few turns: its wait ends through a task)
        running = batcher.workers.pending()
        assert len(running) == 1
        running[0].reply()  # instance 0 takes the pinned request: the queue is empty
        await first
        await batcher.workers.next_call("the pinned request")
        batcher.clock.advance(1.0)  # so the next request's deadline is past that plan
        held = await batcher.send(rows=1)  # instance 0 is busy: held on instance 1 to fill
        assert len(batcher.workers.pending()) == 1
        batcher.clock.advance(0.006)  # past max_delay_s
        calls = await eventually(
            lambda: len(batcher.workers.pending()) == 2 and batcher.workers.pending(),
            what="the held request to go",
        )
        for call in calls:
            call.reply()
        for task in (pinned, held):
            outputs, _ = await task
            assert outputs["y"].shape == (1, 4)
    finally:
        await batcher.stop()


async def test_a_request_queued_behind_busy_instances_starts_when_one_comes_back() -> None:
    """The loop is asleep on a long plan (a request pinned to a busy instance, 30 s away)
    when that request starts and leaves the queue empty; the other instance's worker then
    crashes, and a request queues with no instance free. Once the restarted instance is
    ready, that request starts there (the loop's idle poll, 50 ms), not 30 s later."""
    served = await Served(2, QueuePolicy(max_batch_size=0), backoff_initial_s=0.01).start()
    x = np.ones((1, 4), np.float32)

    def submit(instance: int | None = None) -> asyncio.Task[Answer]:
        return asyncio.create_task(
            served.scheduler.submit(
                {"x": x}, None, ("y",), BATCH, BATCH.deadline_s, 10.0, instance=instance
            )
        )

    try:
        first = submit()
        await served.workers.next_call("the first request")  # on instance 0
        pinned = submit(instance=0)  # queued behind instance 0, while instance 1 is free
        for _ in range(10):  # the loop wakes and plans for the pinned request's deadline
            await asyncio.sleep(0)
        served.worker(0).pending[0].reply()  # instance 0 takes the pinned request
        await first
        crashed = served.worker(1)
        crashed.end("crashed")  # instance 1 restarts
        served.clock.advance(1.0)  # the next request's deadline is past the loop's plan
        queued = submit()
        calls = await eventually(
            lambda: served.worker(1) is not crashed and served.worker(1).pending,
            what="the queued request to start on the restarted instance",
        )
        for call in [*calls, *served.worker(0).pending]:
            call.reply()
        for task in (pinned, queued):
            outputs, _ = await asyncio.wait_for(task, 5)
            assert outputs["y"].shape == (1, 4)
    finally:
        await served.stop()


async def test_a_request_pinned_to_a_restarting_instance_runs_once_it_is_back() -> None:
    """A request pinned to an instance (a sequence's) whose worker is restarting, while
    the other instance is free, runs on its instance once the restart is done, not at
    its queue deadline (30 s: the loop had no reason to look again before it)."""
    served = await Served(2, QueuePolicy(max_batch_size=0), backoff_initial_s=0.01).start()
    x = np.ones((1, 4), np.float32)
    try:
        crashed = served.worker(1)
        crashed.end("crashed")  # instance 1 restarts; instance 0 is free
        pinned = asyncio.create_task(
            served.scheduler.submit(
                {"x": x}, None, ("y",), BATCH, BATCH.deadline_s, 10.0, instance=1
            )
        )
        calls = await eventually(
            lambda: served.worker(1) is not crashed and served.worker(1).pending,
            what="the pinned request to run on its restarted instance",
        )
        calls[0].reply()
        outputs, _ = await asyncio.wait_for(pinned, 5)
        assert outputs["y"].shape == (1, 4)
        assert not served.worker(0).pending  # never sent to the other instance
    finally:
        await served.stop()
