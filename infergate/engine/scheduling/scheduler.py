"""The scheduler of one served model version: admits requests into its JobQueue, and a
small loop hands batches to idle instances as they free up (running them is runner.py's).

Large requests are cut into chunks of at most max_batch_size rows, so a more urgent
request waits behind at most one running chunk per instance (preemption at batch
granularity). Every request ends in exactly one answer: its outputs, 504 when its deadline
passed in the queue (it never runs; once a chunk started, the rest are never expired),
503 when the queue was full or it was shed, or 400 when it has more chunks than the queue
can ever hold. A caller that gives up (its task is cancelled) leaves its batch running:
the worker finishes it, the batch's other callers get their rows, and its own are dropped.
What waits in the queue when no instance can ever run it (the version stops, or its last
instance fails: a request waiting for a restart to run again) is answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Hashable
from functools import partial

from infergate.clock import Clock
from infergate.engine.lifecycle import readiness
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.scheduling import refusals
from infergate.engine.scheduling.affinity import pinned_instance
from infergate.engine.scheduling.batching import rows_of, split_rows
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import (
    Fairness,
    Group,
    Job,
    JobQueue,
    QueueFull,
    QueuePolicy,
)
from infergate.engine.scheduling.returners import Returners
from infergate.engine.scheduling.runner import Batch, BatchRunner, ServedWell, may_move
from infergate.engine.scheduling.tickets import Answer, Ticket, Work
from infergate.engine.triton.stats import VersionStats
from infergate.metrics import Metrics
from infergate.tensors import Array

# While work waits and no instance is free (one may be restarting), look again this often.
_IDLE_POLL_S = 0.05
_ANONYMOUS = Fairness()


class Scheduler:
    def __init__(
        self,
        name: str,
        version: int,
        instances: list[Instance],
        policy: QueuePolicy,
        clock: Clock,
        metrics: Metrics,
        served_well: ServedWell | None = None,
    ) -> None:
        self.name = name
        self.version = version
        self.policy = policy
        self._instances = instances
        self._clock = clock
        self._metrics = metrics
        self._queue: JobQueue[Work] = JobQueue(policy, _wanted)
        self.stats = VersionStats()  # Triton's per-version statistics
        # The callers of the batches just answered, on their way back (returners.py).
        self._returners = Returners(policy.max_delay_s, policy.max_batch_size, len(instances))
        self._runner = BatchRunner(
            name,
            instances,
            self._queue,
            clock,
            metrics,
            self.stats,
            self._instance_freed,
            self._returners,
            served_well,
        )
        self._alarm = _Alarm()  # rung when the loop must look again before it planned
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop  # the loop `_task` runs on
        self._fill_by: float | None = None  # when a filling batch must go
        self._sleep_until: float | None = None  # when the loop looks again by itself
        self._batches: set[asyncio.Task[None]] = set()  # awaited by no caller: kept alive here
        for instance in instances:  # one back from a restart may take what waits for it
            instance.on_ready = partial(self._instance_freed, True)
            instance.on_failed = partial(self._instance_failed, instance.index)

    def keep_tenants_apart(self, seconds: float) -> None:
        """For `seconds`, batch no tenant's requests with another's: the breaker saw only
        the batches they shared go wrong, and batches of one tenant's own tell whose rows
        did it (a tenant whose slow rows always rode in another's batches was never cut
        off, and the other's requests stayed slow)."""
        self._queue.apart_until = max(self._queue.apart_until, self._clock.now() + seconds)

    def depth_by_class(self) -> dict[str, int]:
        return self._queue.depth_by_class()

    def _ensure_running(self) -> asyncio.AbstractEventLoop:
        """Start the scheduler's loop if it is not running; the event loop it runs on.
        Kept rather than asked for: in Python 3.11 `asyncio.get_running_loop()` is a
        getpid() system call each time (a fork check), and this runs for every request."""
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name=f"scheduler:{self.name}")
            self._runner.loop = self._loop
        return self._loop

    async def stop(self) -> None:
        self._runner.stopped = True  # a batch failing from now on is answered, not requeued
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        error = refusals.stopped(self.name, self.version)
        for job in self._queue.clear():  # a started request's chunks too: none will run
            job.payload.ticket.fail(error)

    def _instance_failed(self, index: int) -> None:
        """An instance failed, and is not restarted: the work that was to run again on it
        alone (runner.py) may run on any other. When no instance is left that could come
        back, nothing queued can ever run (a request waiting for a restart to run again, a
        started request's chunks, which never expire): it fails now, with why."""
        if any(i.state not in ("failed", "stopped") for i in self._instances):
            if self._queue.unpin(index, may_move):
                self._pump()
            return
        reason = readiness.first_reason(self._instances)
        error = readiness.not_ready_error(self.name, self.version, "failed", reason)
        for job in self._queue.clear():
            job.payload.ticket.fail(error)

    async def submit(
        self,
        inputs: dict[str, Array],
        key: Hashable,
        outputs: tuple[str, ...],
        cls: PriorityClass,
        queue_deadline_s: float,
        timeout_s: float,
        session: str | None = None,
        fair: Fairness | None = None,
        instance: int | None = None,
    ) -> Answer:
        """Queue a request and await its outputs (`enqueue`, awaited)."""
        return await self.enqueue(
            inputs, key, outputs, cls, queue_deadline_s, timeout_s, session, fair, instance
        )

    def enqueue(
        self,
        inputs: dict[str, Array],
        key: Hashable,
        outputs: tuple[str, ...],
        cls: PriorityClass,
        queue_deadline_s: float,
        timeout_s: float,
        session: str | None = None,
        fair: Fairness | None = None,
        instance: int | None = None,
        counted: bool = False,
    ) -> Awaitable[Answer]:
        """Queue a request now; await what this returns for its outputs. Requests with an
        equal, non-None `key` may run in one batch; None runs alone. `queue_deadline_s`
        bounds its wait to start, `timeout_s` its execution (past it the worker is killed).
        With `instance` it runs there only, and is never retried elsewhere (a sequence's
        request). `counted`: its batch counts its success for the breaker and the
        statistics (`Ticket.counted`), when it runs in one piece. What it returns is the
        request's own future when it queued, which its caller's task awaits directly: no
        coroutine level of the scheduler's own on the way (each level costs at every
        suspension and resumption)."""
        now = self._clock.now()
        loop = self._ensure_running()
        future: asyncio.Future[Answer] = loop.create_future()
        # Where and for whom it runs, given to its jobs before the queue tags them.
        pin = pinned_instance(session, self._instances) if instance is None else instance
        jobs = self._jobs(
            inputs, key, outputs, cls, now, queue_deadline_s, timeout_s, future, pin, fair, counted
        )
        if instance is not None:  # a sequence's: it runs on its instance or not at all
            for job in jobs:
                job.payload.bound = True
        self._admit(jobs, cls)
        self._returners.arrived()
        if self._fill_by is not None:
            # The usual request under load: while a batch runs, or its callers are on
            # their way back, a free instance holds back for its batch to fill. Unless
            # this request fills it (or is one of the last callers awaited), or a job is
            # late (the pump expires it: it must not hold a place in the queue), a pump
            # would only find that again: the verdict is the same for every free instance
            # while no job is pinned, and no instance was taken since (only a pump
            # launches).
            holds, awaited = self._returners.hold(bool(self._runner.busy), now)
            fill_by = self._queue.filling_until(now) if holds else None
            next_deadline = self._queue.next_deadline()
            if fill_by is not None and (next_deadline is None or next_deadline >= now):
                self._fill_by = fill_by if awaited is None else min(fill_by, awaited)
                self._plan_for(jobs[0].deadline)
                return future
        inline = self._pump(own=jobs[0].payload.ticket, now=now)
        if inline is not None:
            return self._own_batch(inline, future)
        self._plan_for(jobs[0].deadline)
        return future

    def _plan_for(self, deadline: float) -> None:
        """Wake the loop when a request that queued with `deadline` needs it to look
        again sooner than it planned."""
        if self._sleep_until is None or self._due(deadline) < self._sleep_until:
            self._alarm.ring()

    async def _own_batch(self, batch: Batch, future: asyncio.Future[Answer]) -> Answer:
        """A request's own batch, awaited in its caller's task: no task hop."""
        try:
            await self._runner.finish(batch)
        except asyncio.CancelledError:
            # The caller gave up; the worker still runs the batch, so someone must await
            # its reply before the instance takes another.
            self._keep(batch)
            raise
        return await future

    def _due(self, deadline: float) -> float:
        """When the loop must look at a request that just queued: its deadline, or sooner
        when it waits on a free instance for its batch to fill (the loop may be asleep on
        a plan made before: a reply that empties the queue does not wake it)."""
        return deadline if self._fill_by is None else min(deadline, self._fill_by)

    def _jobs(
        self,
        inputs: dict[str, Array],
        key: Hashable,
        outputs: tuple[str, ...],
        cls: PriorityClass,
        now: float,
        queue_deadline_s: float,
        timeout_s: float,
        future: asyncio.Future[Answer],
        pin: int | None,
        fair: Fairness | None,
        counted: bool = False,
    ) -> list[Job[Work]]:
        """The request as queue jobs: one, or a chunk of at most max_batch_size rows each."""
        batching = key is not None and self._queue.batching
        rows = rows_of(inputs) if batching else 1
        if not batching or rows <= self.policy.max_batch_size:  # the usual request: one job
            ticket = Ticket(outputs, timeout_s, 1, future, counted)
            job_key = key if batching else None
            fair = fair or _ANONYMOUS
            return [
                Job(
                    Work(ticket, 0, inputs),
                    cls,
                    now,
                    now + queue_deadline_s,
                    rows,
                    job_key,
                    pin,
                    fair,
                )
            ]
        chunks = split_rows(inputs, self.policy.max_batch_size)
        if len(chunks) > self.policy.max_queue_size:
            raise refusals.too_large(self.name, rows, len(chunks), self.policy)
        self._runner.chunked = True
        ticket = Ticket(outputs, timeout_s, len(chunks), future)
        group = Group()  # once one chunk starts, none of them expires
        return [
            Job(
                Work(ticket, i, c),
                cls,
                now,
                now + queue_deadline_s,
                rows_of(c),
                key,
                pin,
                fair or _ANONYMOUS,
                group,
            )
            for i, c in enumerate(chunks)
        ]

    def _admit(self, jobs: list[Job[Work]], cls: PriorityClass) -> None:
        try:
            shed = self._queue.admit(jobs)
        except QueueFull:
            self._metrics.shed.labels(self.name, cls.name, "queue_full").inc()
            raise refusals.queue_full(self.name, len(self._queue), self.policy) from None
        for victim in shed:
            self._metrics.shed.labels(self.name, victim.cls.name, "shed").inc()
            if victim.cls.rank == cls.rank:  # its tenant held more of the queue (queue.py)
                victim.payload.ticket.fail(refusals.over_share(self.name, victim.cls))
            else:
                victim.payload.ticket.fail(refusals.shed(self.name, victim.cls, cls))

    def _keep(self, batch: Batch) -> None:
        """Finish `batch` in a task of its own, held until it is done."""
        task = asyncio.create_task(self._runner.finish(batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    def _pump(self, own: Ticket | None = None, now: float | None = None) -> Batch | None:
        """Expire what is late, then start every batch that can start now. A batch made
        only of `own`'s work is handed back for the caller to await instead of a new task."""
        self._fill_by = None
        if not len(self._queue):  # a lone client's reply: nothing to expire or start
            return None
        if now is None:
            now = self._clock.now()
        for job in self._queue.expire(now):
            self._expired(job, now)
        inline = None
        for instance in self._runner.free_in_order():
            # Holding a part-full batch back pays only while another batch is running, or
            # the callers of the last ones were just answered: they are on their way back
            # (returners.py). Otherwise no one is coming to fill it (a lone client, however
            # many rows it sends), and the instance would sit idle: go now. Requests that
            # queued behind a busy instance are merged when it frees up.
            loaded, awaited = self._returners.hold(bool(self._runner.busy), now)
            taken = self._queue.take(now, may_wait=loaded, instance=instance.index)
            if taken is None:
                continue  # nothing this instance may run (the rest is pinned elsewhere)
            if isinstance(taken, float):
                if awaited is not None:
                    taken = min(taken, awaited)
                self._fill_by = min(taken, self._fill_by or taken)
                continue
            batch = self._runner.launch(instance, taken, now)
            if batch is None:
                continue
            if inline is None and own is not None and all(j.payload.ticket is own for j in taken):
                inline = batch
            else:
                self._keep(batch)
        return inline

    def _instance_freed(self, pump: bool) -> None:
        if pump:
            self._pump()
            if not len(self._queue):
                # Nothing waits, so the loop has nothing to plan anew: waking it would cost
                # a lone client a task switch and a second pump per request. Its plan may
                # be stale now (made for a request that has since started), so the next
                # request that has to queue wakes it (`submit`): with no instance free,
                # only the loop's idle poll notices one that comes back from a restart.
                self._sleep_until = None
                return
        self._alarm.ring()  # the loop plans its next look again

    async def _run(self) -> None:
        while True:
            self._alarm.reset()
            self._pump()
            now = self._clock.now()
            timeout = self._sleep_for(now, self._fill_by, bool(self._runner.free()))
            self._sleep_until = None if timeout is None else now + timeout
            await self._alarm.sleep(self._loop, timeout)

    def _sleep_for(self, now: float, wake_at: float | None, any_free: bool) -> float | None:
        times = [t for t in (wake_at, self._queue.next_deadline()) if t is not None]
        if len(self._queue) and not any_free:
            times.append(now + _IDLE_POLL_S)
        if not times:
            return None
        # A hair past the deadline, so the job has expired when the loop looks again.
        return max(0.0, min(times) - now) + 0.0002

    def _expired(self, job: Job[Work], now: float) -> None:
        self._metrics.shed.labels(self.name, job.cls.name, "deadline").inc()
        waited, patience = now - job.arrival, job.deadline - job.arrival
        first = job.payload.failed_with
        if first is not None:  # its one more try (runner.py) found no instance in time
            job.payload.ticket.fail(refusals.not_run_again(first, waited, patience))
        else:
            job.payload.ticket.fail(refusals.expired(self.name, job.cls, waited, patience))


class _Alarm:
    """The scheduler loop's sleep: until rung, or until a time has passed. A future and a
    timer: `asyncio.wait_for(event.wait(), timeout)` made a task, a waiter future and a
    timer for every sleep, and asked for the running loop (in Python 3.11 a getpid()
    system call) twice; the loop sleeps about once a batch under load."""

    __slots__ = ("_rung", "_waiter")

    def __init__(self) -> None:
        self._rung = False  # rung since the last reset: the next sleep returns at once
        self._waiter: asyncio.Future[None] | None = None

    def ring(self) -> None:
        self._rung = True
        _wake(self._waiter)

    def reset(self) -> None:
        self._rung = False

    async def sleep(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        if self._rung:
            return
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _wanted(job: Job[Work]) -> bool:
    """Whether the caller of a queued job still waits for it (JobQueue drops it if not)."""
    return not job.payload.ticket.future.done()
