"""Timing rules in-process, on the FakeClock, through the worker seam: deadlines, a full
queue and shedding, retries (on a sibling, or after a restart), a batch re-run request by
request, restart backoff and memory kills. Real Instances and Scheduler; in-process fake
workers (tests/fake_workers.py) that answer when the test says, so time moves only when
the test advances the clock, and the verdict is the same on any machine. The engine's
(breakers, timeouts, queries of death) are in test_timing_rules_engine.py; end-to-end
smoke tests of the same rules, on real processes, in test_scheduler.py, test_workers.py
and test_tenants.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from contextlib import _AsyncGeneratorContextManager
from typing import Any

import numpy as np
import pytest

from infergate.engine.lifecycle.instance import Instance
from infergate.engine.lifecycle.load_slots import LoadSlots
from infergate.engine.scheduling.classes import DEFAULT_CLASSES, PriorityClass
from infergate.engine.scheduling.queue import Fairness, QueuePolicy
from infergate.errors import (
    DataNotServable,
    DeadlineExceeded,
    ModelFailed,
    Overloaded,
    WorkerFailed,
    WorkerOverMemory,
)
from infergate.metrics import Metrics
from tests.fake_served import Answer, Served
from tests.fake_workers import FakeCall, FakeWorker
from tests.polling import eventually

REALTIME, BURST, BATCH = DEFAULT_CLASSES  # deadlines 50 ms, 200 ms, 30 s


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """One series' value; a missing series fails the test (it is not a zero)."""
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, f"no series {name}{labels}"
    return value


@pytest.fixture
async def one() -> AsyncIterator[Served]:
    served = await Served(1, QueuePolicy(max_batch_size=1), backoff_initial_s=1000).start()
    yield served
    await served.stop()


@pytest.fixture
async def three() -> AsyncIterator[Served]:
    served = await Served(3, QueuePolicy(max_batch_size=1), backoff_initial_s=1000).start()
    yield served
    await served.stop()


async def test_a_request_that_cannot_start_by_its_deadline_gets_504_and_never_runs(
    one: Served,
) -> None:
    holder = await one.submit(BATCH)
    running = await one.workers.next_call()
    late = await one.submit(REALTIME, rows=3)  # 50 ms to start; the only worker is busy
    one.clock.advance(0.049)
    await one.submit(BATCH)  # each submit looks at the queue: the realtime one may still start
    assert not late.done()
    one.clock.advance(0.002)
    await one.submit(BATCH)
    with pytest.raises(DeadlineExceeded) as expired:
        await late
    message = str(expired.value)
    assert "waited 51 ms in the queue, past its deadline of 50 ms (realtime class)" in message
    assert "it was not run" in message
    assert (
        sample(
            one.context.metrics,
            "infergate_requests_shed_total",
            model="m",
            reason="deadline",
            **{"class": "realtime"},
        )
        == 1
    )  # noqa: E501
    running.reply()
    await holder
    while one.workers.pending():  # the two batch-class requests run; the late one never
        (await one.workers.next_call()).reply()
    assert [c.rows for c in one.worker(0).calls] == [1, 1, 1]


async def test_a_request_that_started_is_never_expired_by_its_deadline(one: Served) -> None:
    task = await one.submit(REALTIME)
    call = await one.workers.next_call()
    one.clock.advance(3600)  # far past its 50 ms: it started, so it finishes
    call.reply()
    outputs, timing = await task
    assert outputs["pid"].tolist() == [[one.worker(0).pid]]
    assert timing.compute_s == 3600


@pytest.fixture
async def short_queue() -> AsyncIterator[Served]:
    served = await Served(
        1, QueuePolicy(max_batch_size=1, max_queue_size=2), backoff_initial_s=1000
    ).start()
    yield served
    await served.stop()


async def test_a_full_queue_refuses_and_a_higher_class_sheds_a_lower_one(
    short_queue: Served,
) -> None:
    one = short_queue
    holder = await one.submit(BATCH)
    running = await one.workers.next_call()
    first, second = await one.submit(BATCH, rows=2), await one.submit(BATCH, rows=2)
    refused = await one.submit(BATCH)  # max_queue_size = 2, nothing lower to shed
    with pytest.raises(Overloaded, match=r"max_queue_size = 2"):
        await refused
    urgent = await one.submit(REALTIME, rows=3)
    shed = await eventually(lambda: [t for t in (first, second) if t.done()], what="a shed")
    assert len(shed) == 1  # exactly one batch-class request made room
    with pytest.raises(Overloaded, match="was shed to make room for a realtime one"):
        await shed[0]
    running.reply()
    await holder
    nxt = await one.workers.next_call()
    assert nxt.rows == 3  # the realtime request goes before the batch one queued earlier
    nxt.reply()
    await urgent
    (await one.workers.next_call()).reply()
    kept = first if shed[0] is second else second
    await kept
    metrics = one.context.metrics
    assert (
        sample(
            metrics,
            "infergate_requests_shed_total",
            model="m",
            reason="queue_full",
            **{"class": "batch"},
        )
        == 1
    )  # noqa: E501
    assert (
        sample(
            metrics, "infergate_requests_shed_total", model="m", reason="shed", **{"class": "batch"}
        )
        == 1
    )  # noqa: E501


async def test_a_batch_one_request_s_data_broke_runs_again_request_by_request() -> None:
    """A batch failing with DataNotServable (onnxruntime cannot return a string that is not
    UTF-8: the data of one request in it) is not the others' fault: each request runs
    again alone, the others are answered, and only the one whose data it was gets the
    400."""
    served = await Served(1, QueuePolicy(max_batch_size=4), backoff_initial_s=1000).start()
    try:

        def send(value: float) -> asyncio.Task[Any]:
            x = np.full((1, 4), value, np.float32)
            return asyncio.create_task(
                served.scheduler.submit({"x": x}, "k", ("y",), BURST, BURST.deadline_s, 10.0)
            )

        first = send(0)
        busy = await served.workers.next_call()
        good, bad = send(1), send(2)
        await asyncio.sleep(0)
        busy.reply()  # the two queued behind it go as one batch
        both = await served.workers.next_call(what="the two as one batch")
        assert both.rows == 2
        broken = DataNotServable("cannot serve this request's data: not UTF-8")
        both._answer(broken)  # as the worker's reply would: the data of `bad` in it
        for what in ("each again, alone", "the other, alone"):
            call = await served.workers.next_call(what=what)
            assert call.rows == 1
            if call.inputs["x"][0, 0] == 2:  # bad's
                call._answer(broken)
            else:
                call.reply()
        await first
        outputs, _ = await good
        assert outputs["y"].tolist() == [[1.0] * 4]
        with pytest.raises(DataNotServable, match="not UTF-8"):
            await bad
        assert not served.workers.pending()
    finally:
        await served.stop()


def worker_of(call: FakeCall) -> FakeWorker:
    return call.worker


async def test_a_request_on_a_dead_worker_is_retried_once_on_a_sibling(three: Served) -> None:
    task = await three.submit(BURST)
    first = await three.workers.next_call()
    first.worker.end("was killed by signal 9")
    retry = await three.workers.next_call(what="the retry on a sibling")
    assert retry.worker is not first.worker
    retry.reply()
    outputs, _ = await task
    assert outputs["pid"].tolist() == [[retry.worker.pid]]  # the sibling answered
    # One retry only: when the sibling dies too, the request fails though a third is ready.
    again = await three.submit(BURST)
    on = await three.workers.next_call()
    on.worker.end("exited with code 3")
    second = await three.workers.next_call(what="the retry")
    assert three.instances[2].ready
    second.worker.end("exited with code 3")
    with pytest.raises(WorkerFailed, match="exited with code 3"):
        await again
    assert not three.workers.pending()


async def test_a_batch_failing_after_its_scheduler_stopped_is_answered(three: Served) -> None:
    """A version stopping (a drain that ran out) while a batch runs: the batch's worker dies
    then, and its request is answered at once, not queued again for a loop that is gone."""
    task = await three.submit(BURST)
    call = await three.workers.next_call()
    await three.scheduler.stop()
    call.worker.end("was stopped with its version")
    with pytest.raises(WorkerFailed, match="stopped with its version"):
        await asyncio.wait_for(task, 5)  # hung for good before: a retry nobody would run
    assert not three.workers.pending()


async def test_no_retry_after_a_lone_request_s_memory_kill(three: Served) -> None:
    task = await three.submit(BURST)
    call = await three.workers.next_call()
    call.worker.kill_over_memory("it used 500 MB, over its memory limit of 300 MB")
    with pytest.raises(WorkerOverMemory, match="over its memory limit"):
        await task  # the sibling would die the same way
    assert sum(len(w.calls) for w in three.workers.made) == 1
    for index in range(3):
        if three.instances[index].ready and three.worker(index) is not call.worker:
            three.worker(index).end("was killed by signal 9")
    assert not any(i.ready for i in three.instances)


Sent = asyncio.Task[Answer]


def keyed(served: Served, value: float, cls: PriorityClass = BURST) -> Sent:
    """A request of one row that may share a batch: `x` all `value`."""
    x = np.full((1, 4), value, np.float32)
    return asyncio.create_task(
        served.scheduler.submit({"x": x}, "k", ("y",), cls, cls.deadline_s, 10.0)
    )


async def two_in_a_batch(served: Served) -> tuple[Sent, Sent, FakeCall]:
    """A good request (x = 1) and a bad one (x = 2) that wait behind a running one, then
    run as one batch: the two, and the batch's call."""
    first = keyed(served, 0)
    busy = await served.workers.next_call()
    good, bad = keyed(served, 1), keyed(served, 2)
    await asyncio.sleep(0)
    busy.reply()  # the two queued behind it go as one batch
    both = await served.workers.next_call(what="the two as one batch")
    assert both.rows == 2
    await first
    return good, bad, both


def is_bad(call: FakeCall) -> bool:
    return bool(call.inputs["x"][0, 0] == 2)


def of(served: Served, tenant: str, instance: int | None = None) -> Sent:
    """A request of one row of `tenant` that may share a batch (with `instance`: a
    sequence's, run there or not at all)."""
    x = np.ones((1, 4), np.float32)
    return asyncio.create_task(
        served.scheduler.submit(
            {"x": x}, "k", ("y",), BURST, BURST.deadline_s, 10.0, None, Fairness(tenant), instance
        )
    )


async def test_a_batch_several_tenants_shared_names_them_to_its_callers() -> None:
    """Each caller of a batch that held several tenants' requests learns whose, with its
    answer (`Timing.shared`) or with its error where it cannot run again alone (a
    sequence's): the breaker counts the batch for them together, not as each one's own.
    A batch of one tenant's requests names nobody."""
    served = await Served(1, QueuePolicy(max_batch_size=4), backoff_initial_s=1000).start()
    both = frozenset({"alice", "bob"})
    try:
        for tenants, shared in ((("alice", "alice"), None), (("alice", "bob"), both)):
            first = of(served, "carol")
            busy = await served.workers.next_call()
            sent = [of(served, tenant) for tenant in tenants]
            await asyncio.sleep(0)
            busy.reply()  # the two queued behind it go as one batch
            batch = await served.workers.next_call(what="the two as one batch")
            assert batch.rows == 2
            batch.reply()
            assert (await first)[1].shared is None
            assert [(await t)[1].shared for t in sent] == [shared, shared]
        first = of(served, "carol", 0)
        busy = await served.workers.next_call()
        sent = [of(served, tenant, 0) for tenant in ("alice", "bob")]
        await asyncio.sleep(0)
        busy.reply()
        batch = await served.workers.next_call(what="the sequences' two as one batch")
        assert batch.rows == 2
        batch.worker.end("was killed by signal 11")
        for task in sent:
            with pytest.raises(WorkerFailed) as failed:
                await task
            assert failed.value.shared == both
            assert "signal 11" in str(failed.value)
    finally:
        await served.stop()


async def test_a_batch_whose_outputs_do_not_split_into_its_rows_runs_again_alone() -> None:
    """A batch's output without one row per request (a model that does not keep rows
    apart) cannot be cut back into the requests' rows: each request runs again alone and
    gets its own answer, where before every caller of the batch got a 500."""
    served = await Served(1, QueuePolicy(max_batch_size=4), backoff_initial_s=1000).start()
    try:
        good, bad, both = await two_in_a_batch(served)
        both.reply({"y": np.zeros((3, 4), np.float32)})  # 3 rows for a batch of 2
        for what in ("each again, alone", "the other, alone"):
            call = await served.workers.next_call(what=what)
            assert call.rows == 1
            call.reply()
        assert (await good)[0]["y"].tolist() == [[1.0] * 4]
        assert (await bad)[0]["y"].tolist() == [[2.0] * 4]
        assert not served.workers.pending()
    finally:
        await served.stop()


async def test_a_batch_past_its_timeout_runs_again_request_by_request() -> None:
    """A batch of two runs past the model's timeout (one request's input makes it slow):
    its worker is killed, and each request runs again alone, here once the only instance
    has restarted. Only the one slow alone gets the 504 (its lone run times out too, and
    it is not run a third time); the other is answered. Before, both got the 504. Nothing
    goes to the killed worker in the moment before its kill lands."""
    served = await Served(1, QueuePolicy(max_batch_size=4), backoff_initial_s=0.001).start()
    try:
        good, bad, both = await two_in_a_batch(served)
        killed = both.worker
        both.time_out()
        for what in ("each again, alone", "the other, alone"):
            call = await served.workers.next_call(what=what)
            assert call.rows == 1
            assert call.worker is not killed
            if is_bad(call):
                call.time_out()
            else:
                call.reply()
        outputs, _ = await good
        assert outputs["y"].tolist() == [[1.0] * 4]
        with pytest.raises(DeadlineExceeded, match="did not answer within"):
            await bad
        assert len(killed.calls) == 2  # the first request, and the batch
        assert sum(len(w.calls) for w in served.workers.made) == 4
        assert sample(served.context.metrics, "infergate_retries_total", model="m") == 2
    finally:
        await served.stop()


async def test_a_batch_killed_for_its_memory_runs_again_request_by_request() -> None:
    """A batch of two whose worker is killed past its memory limit (one request's input
    takes it): each request runs again alone; only the one killed again alone gets the
    503. Before, neither was run again, and both got the 503."""
    served = await Served(1, QueuePolicy(max_batch_size=4), backoff_initial_s=0.001).start()
    instance = served.instances[0]
    try:
        good, bad, both = await two_in_a_batch(served)
        instance.kill_over_memory(500, 300)  # as the memory monitor does
        for what in ("each again, alone", "the other, alone"):
            call = await served.workers.next_call(what=what)
            assert call.rows == 1
            if is_bad(call):
                instance.kill_over_memory(500, 300)
            else:
                call.reply()
        outputs, _ = await good
        assert outputs["y"].tolist() == [[1.0] * 4]
        with pytest.raises(WorkerOverMemory, match="over its memory limit"):
            await bad
        assert sum(len(w.calls) for w in served.workers.made) == 4
        await eventually(lambda: instance.ready, what="the restart")  # kills while running
    finally:
        await served.stop()


async def test_work_on_the_only_instance_gets_one_more_try_once_it_restarted() -> None:
    """With no sibling, the work of a worker that died waits for its restart and runs then,
    alone: one more try, as on a sibling. Before, it failed at once. Once only: when the
    restarted worker dies too, the request fails."""
    served = await Served(1, QueuePolicy(max_batch_size=1), backoff_initial_s=0.001).start()
    try:
        task = await served.submit(BURST)
        first = await served.workers.next_call()
        first.worker.end("was killed by signal 9")
        retry = await served.workers.next_call(what="the retry, once restarted")
        assert retry.worker is not first.worker
        retry.reply()
        outputs, _ = await task
        assert outputs["pid"].tolist() == [[retry.worker.pid]]
        again = await served.submit(BURST)
        (await served.workers.next_call()).worker.end("exited with code 3")
        (await served.workers.next_call(what="the retry")).worker.end("exited with code 3")
        with pytest.raises(WorkerFailed, match="exited with code 3"):
            await again
        assert sample(served.context.metrics, "infergate_retries_total", model="m") == 2
    finally:
        await served.stop()


async def test_a_retry_that_cannot_start_by_its_deadline_gets_the_worker_s_error(
    one: Served,
) -> None:
    """The only instance is not back (its backoff is 1000 s) when the retry's deadline
    (a fresh one: burst, 200 ms) passes: the caller gets the worker's 503, saying so, not
    a 504 for a request "not run"."""
    task = await one.submit(BURST)
    (await one.workers.next_call()).worker.end("was killed by signal 9")
    await eventually(lambda: one.scheduler.depth_by_class() == {"burst": 1}, what="the retry")
    one.clock.advance(0.201)
    with pytest.raises(WorkerFailed) as failed:
        await asyncio.wait_for(task, 10)  # the scheduler notices on its own
    said = str(failed.value)
    assert "killed by signal 9" in said
    assert (
        "it was to run again alone, but no instance could take it within its deadline "
        "of 200 ms (it waited 201 ms). Hint: retry shortly"
    ) in said, said
    assert len(one.workers.made) == 1  # not restarted yet
    metrics = one.context.metrics
    assert sample(metrics, "infergate_retries_total", model="m") == 1


async def test_a_retry_waiting_for_a_restart_fails_at_once_when_the_instance_fails() -> None:
    """A request waiting for the only instance's restart (its class waits 30 s) fails as
    soon as the instance fails for good (here its supervisor hits a bug), with why: it
    would have waited out its deadline for an instance that never comes."""
    served = await Served(1, QueuePolicy(max_batch_size=1), backoff_initial_s=0.001).start()
    try:
        task = await served.submit(BATCH)
        call = await served.workers.next_call()
        served.workers.start_bug = RuntimeError("the restart hit a bug")
        call.worker.end("was killed by signal 9")
        with pytest.raises(ModelFailed, match="the restart hit a bug"):
            await asyncio.wait_for(task, 10)
        assert served.instances[0].state == "failed"
    finally:
        await served.stop()


async def test_a_retry_waiting_for_a_restart_fails_at_once_when_its_version_stops(
    one: Served,
) -> None:
    task = await one.submit(BATCH)
    (await one.workers.next_call()).worker.end("was killed by signal 9")
    await eventually(lambda: one.scheduler.depth_by_class() == {"batch": 1}, what="the retry")
    await one.scheduler.stop()  # an unload, the gateway stopping
    with pytest.raises(Overloaded, match="was stopped"):
        await asyncio.wait_for(task, 5)


async def test_a_stopped_version_answers_a_started_request_s_waiting_chunks() -> None:
    """A large request's chunks never expire once one started; a version that stops
    answers them anyway. Before, they stayed queued and the request hung."""
    served = await Served(1, QueuePolicy(max_batch_size=2), backoff_initial_s=1000).start()
    try:
        x = np.zeros((6, 4), np.float32)  # three chunks of two rows
        task = asyncio.create_task(
            served.scheduler.submit({"x": x}, "k", ("y",), BURST, BURST.deadline_s, 10.0)
        )
        running = await served.workers.next_call()  # the first chunk
        await served.scheduler.stop()
        running.reply()  # its worker finishes the call in hand, then stops
        with pytest.raises(Overloaded, match="was stopped"):
            await asyncio.wait_for(task, 5)
    finally:
        await served.stop()


async def crash_and_wait_restart(served: Served, instance: Instance) -> None:
    old = instance.handle
    assert isinstance(old, FakeWorker)
    old.end("exited with code 3")
    await eventually(lambda: instance.ready and instance.handle is not old, what="the restart")


async def test_restarts_back_off_doubling_to_a_cap_and_reset_once_stable() -> None:
    served = Served(1, QueuePolicy(max_batch_size=1), backoff_initial_s=0.01, backoff_max_s=0.04)
    await served.start()
    instance = served.instances[0]
    try:
        for _ in range(4):
            await crash_and_wait_restart(served, instance)
        served.clock.advance(60)  # up for stable_after_s (60 s): the backoff starts over
        await crash_and_wait_restart(served, instance)
    finally:
        await served.stop()
    waits = [
        e.message.rsplit("restarting in ", 1)[1]
        for e in served.context.events.recent("m")
        if e.kind == "worker_restarting"
    ]
    assert waits == ["0.01 s", "0.02 s", "0.04 s", "0.04 s", "0.01 s"]
    assert instance.restarts == 5
    assert sample(served.context.metrics, "infergate_worker_restarts_total", model="m") == 5


class AskedSlots(LoadSlots):
    """Load slots that remember what each load asked for: whether it was a restart."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.restarts: list[bool] = []

    def slot(self, tenant: Hashable, restart: bool = False) -> _AsyncGeneratorContextManager[None]:
        self.restarts.append(restart)
        return super().slot(tenant, restart)


async def test_a_restart_that_failed_to_load_waits_its_turn_as_a_first_load() -> None:
    """A worker that served and died restarts ahead of other loads (past the limit); when
    that restart fails to load, the next try queues like a first load, so a model that
    cannot come back does not keep jumping ahead of other tenants' loads. Once it serves
    again, its next restart goes first again."""
    served = Served(1, QueuePolicy(max_batch_size=1), backoff_initial_s=0.001)
    slots = served.context.load_slots = AskedSlots(1)
    await served.start()
    instance = served.instances[0]
    other_loading = asyncio.Event()

    async def another_tenant_s_load() -> None:
        async with slots.slot("other"):
            await other_loading.wait()

    other = asyncio.create_task(another_tenant_s_load())
    try:
        await eventually(lambda: slots.busy == 1, what="the other tenant's load to start")
        served.workers.load_error = "its file is gone"
        first = instance.handle
        assert isinstance(first, FakeWorker)
        first.end("exited with code 3")
        await eventually(
            lambda: slots.restarts == [False, False, True, False],
            what="a try after the failed restart",
        )
        assert len(served.workers.made) == 2  # the try waits for the other tenant's slot
        served.workers.load_error = None
        other_loading.set()
        await eventually(lambda: instance.ready, what="the instance back")
        assert len(served.workers.made) == 3
        served.workers.made[-1].end("exited with code 3")
        await eventually(lambda: instance.ready and len(served.workers.made) == 4)
        assert slots.restarts[-1] is True
    finally:
        other_loading.set()
        await other
        await served.stop()


@pytest.mark.parametrize(("apart_s", "failed"), [(0.0, True), (61.0, False)])
async def test_repeated_memory_kills_within_the_window_fail_the_instance(
    apart_s: float, failed: bool
) -> None:
    served = Served(1, QueuePolicy(max_batch_size=1), backoff_initial_s=0.001)
    served.context.max_kills, served.context.kill_window_s = 3, 60.0
    await served.start()
    instance = served.instances[0]
    try:
        for kill in range(3):
            old = instance.handle
            instance.kill_over_memory(500, 300)
            if kill < 2 or not failed:
                await eventually(
                    lambda old=old: instance.ready and instance.handle is not old,  # type: ignore[misc]
                    what="the restart",
                )
            served.clock.advance(apart_s)
        if failed:
            await eventually(lambda: instance.state == "failed", what="the instance to fail")
            assert instance.reason is not None
            assert "killed 3 times within 60 s" in instance.reason
            assert "Hint: raise memory_mb in model.toml" in instance.reason
        else:
            assert instance.state == "ready"  # kills a minute apart never add up
    finally:
        await served.stop()
