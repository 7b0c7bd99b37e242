"""The scheduler of one served model version: admits requests into its JobQueue, and a
small loop hands batches to idle instances as they free up.

Large requests are cut into chunks of at most max_batch_size rows, so a more urgent
request waits behind at most one running chunk per instance (preemption at batch
granularity). Every request ends in exactly one answer: its outputs, 504 when its deadline
passed in the queue (it never runs; once a chunk started, the rest are never expired),
503 when the queue was full or it was shed, or 400 when it has more chunks than the queue
can ever hold. A caller that gives up (its task is cancelled) leaves its batch running:
the worker finishes it, the batch's other callers get their rows, and its own are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from infergate.clock import Clock
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.scheduling.batching import (
    merge,
    rows_of,
    split_rows,
    unmerge,
)
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import (
    Fairness,
    Group,
    Job,
    JobQueue,
    QueueFull,
    QueuePolicy,
)
from infergate.engine.triton.stats import VersionStats
from infergate.engine.workers.protocol import Worker
from infergate.errors import (
    InfergateError,
    ModelExecutionError,
    Overloaded,
    QueueDeadlineExceeded,
    TooLargeForQueue,
    WorkerFailed,
    WorkerOverMemory,
)
from infergate.metrics import Metrics
from infergate.tensors import Array

log = logging.getLogger("infergate.scheduler")

# While work waits and no instance is free (one may be restarting), look again this often.
_IDLE_POLL_S = 0.05
_ANONYMOUS = Fairness()


class Timing(NamedTuple):
    """What a request went through: Triton's statistics read the first two, breakers the
    last (the model's latency: the longest batch it ran in)."""

    queue_s: float
    compute_s: float
    slowest_s: float


@dataclass(eq=False, slots=True)
class _Ticket:
    outputs: tuple[str, ...]
    timeout_s: float
    parts: int
    future: asyncio.Future[tuple[dict[str, Array], Timing]]
    results: dict[int, dict[str, Array]] = field(default_factory=dict)
    queue_s: float = 0.0
    compute_s: float = 0.0
    slowest_s: float = 0.0

    def fail(self, error: InfergateError) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def part_done(
        self,
        index: int,
        outputs: dict[str, Array],
        queue_s: float,
        compute_s: float,
    ) -> None:
        if self.parts == 1:  # the usual case: the whole request ran in one batch
            if not self.future.done():
                self.future.set_result((outputs, Timing(queue_s, compute_s, compute_s)))
            return
        self.results[index] = outputs
        self.queue_s = max(self.queue_s, queue_s)
        self.compute_s += compute_s
        self.slowest_s = max(self.slowest_s, compute_s)
        if len(self.results) == self.parts and not self.future.done():
            merged = merge([self.results[i] for i in range(self.parts)])
            self.future.set_result((merged, Timing(self.queue_s, self.compute_s, self.slowest_s)))


@dataclass(eq=False, slots=True)
class _Work:
    ticket: _Ticket
    index: int
    inputs: dict[str, Array]
    retried: bool = False
    bound: bool = False  # a sequence's: it runs on its instance or not at all


@dataclass(eq=False, slots=True)
class _Batch:
    """One batch on an instance, from leaving the queue to its callers' answers."""

    instance: Instance
    handle: Worker
    jobs: list[Job[_Work]]
    rows: list[int]
    started: float  # when it left the queue
    future: asyncio.Future[dict[str, Array]] | None = None
    replied: float | None = None  # when the worker's reply was read
    released: bool = False


class Scheduler:
    def __init__(
        self,
        name: str,
        version: int,
        instances: list[Instance],
        policy: QueuePolicy,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.name = name
        self.version = version
        self.policy = policy
        self._instances = instances
        self._clock = clock
        self._metrics = metrics
        self._queue: JobQueue[_Work] = JobQueue(policy)
        self._running: set[Instance] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._fill_by: float | None = None  # when a filling batch must go
        self._sleep_until: float | None = None  # when the loop looks again by itself
        self._recent_rows = 1.0  # moving average of batch sizes: a sign of load
        self._orphans: set[asyncio.Task[None]] = set()  # batches whose caller gave up
        self.stats = VersionStats()  # Triton's per-version statistics

    def depth_by_class(self) -> dict[str, int]:
        return self._queue.depth_by_class()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"scheduler:{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        error = Overloaded(f"model {self.name!r} version {self.version} was stopped")
        for job in self._queue.expire(float("inf")):
            job.payload.ticket.fail(error)

    def _pin(self, session: str | None) -> int | None:
        """Session affinity by rendezvous hashing: a session keeps its instance while that
        instance is ready, and moves to the next in its own order when it is not."""
        if session is None or len(self._instances) < 2:
            return None

        def weight(instance: Instance) -> bytes:
            return hashlib.blake2b(f"{session}/{instance.index}".encode(), digest_size=8).digest()

        ranked = sorted(self._instances, key=weight, reverse=True)
        ready = [i for i in ranked if i.ready]
        return (ready or ranked)[0].index

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
    ) -> tuple[dict[str, Array], Timing]:
        """Queue a request and await its outputs. Requests with an equal, non-None `key`
        may run in one batch; None runs alone. `queue_deadline_s` bounds its wait to
        start, `timeout_s` its execution (past it the worker is killed). With `instance`
        it runs there only, and is never retried elsewhere (a sequence's request)."""
        now = self._clock.now()
        batching = key is not None and self._queue.batching
        rows = rows_of(inputs) if batching else 1
        if batching and rows > self.policy.max_batch_size:
            chunks = split_rows(inputs, self.policy.max_batch_size)
        else:
            chunks = [inputs]
        if len(chunks) > self.policy.max_queue_size:
            raise TooLargeForQueue(
                f"request of {rows} rows to model {self.name!r} is cut into {len(chunks)} "
                f"batches of at most {self.policy.max_batch_size} rows, more than its queue "
                f"can ever hold (max_queue_size = {self.policy.max_queue_size}). Hint: send "
                f"at most {self.policy.max_batch_size * self.policy.max_queue_size} rows per "
                "request, or raise max_queue_size or max_batch_size under [batching]"
            )
        future: asyncio.Future[tuple[dict[str, Array], Timing]] = (
            asyncio.get_running_loop().create_future()
        )
        ticket = _Ticket(outputs, timeout_s, len(chunks), future)
        if not batching:
            key = None
        pin = self._pin(session) if instance is None else instance
        deadline = now + queue_deadline_s
        whole = len(chunks) == 1  # then its rows are counted already
        group = None if whole else Group()
        fair = fair or _ANONYMOUS
        jobs = [
            Job(
                _Work(ticket, i, c, bound=instance is not None),
                cls,
                now,
                deadline,
                rows if whole else rows_of(c),
                key,
                pin,
                fair,
                group,
            )
            for i, c in enumerate(chunks)
        ]
        try:
            shed = self._queue.admit(jobs)
        except QueueFull:
            self._metrics.shed.labels(self.name, cls.name, "queue_full").inc()
            raise Overloaded(
                f"model {self.name!r} has {len(self._queue)} requests queued, its limit "
                f"(max_queue_size = {self.policy.max_queue_size}); nothing of a lower class "
                "than yours could be shed. Hint: retry after a pause, or add instances"
            ) from None
        for victim in shed:
            self._metrics.shed.labels(self.name, victim.cls.name, "shed").inc()
            victim.payload.ticket.fail(
                Overloaded(
                    f"model {self.name!r} is overloaded: this {victim.cls.name} request was shed "
                    f"to make room for a {cls.name} one. Hint: retry after a pause"
                )
            )
        self._ensure_running()
        inline = self._pump(own=ticket, now=now)
        if inline is not None:
            # The request's own batch is awaited in its own coroutine: no task hop.
            try:
                await self._finish(inline)
            except asyncio.CancelledError:
                # The caller gave up; the worker still runs the batch, so someone must
                # await its reply before the instance takes another.
                self._orphans.add(asyncio.create_task(self._finish(inline)))
                raise
        elif self._sleep_until is None or jobs[0].deadline < self._sleep_until:
            self._wake.set()  # the loop must look again sooner than it planned
        return await future

    def _free(self) -> list[Instance]:
        return [i for i in self._instances if i.ready and i not in self._running]

    def _pump(self, own: _Ticket | None = None, now: float | None = None) -> _Batch | None:
        """Expire what is late, then start every batch that can start now. A batch made
        only of `own`'s work is handed back for the caller to await instead of a new task."""
        if now is None:
            now = self._clock.now()
        for job in self._queue.expire(now):
            self._expired(job, now)
        self._fill_by = None
        inline = None
        free = self._free()
        for instance in free:
            # Holding a part-full batch back pays only under load: when another batch is
            # running, or recent batches held several rows. Alone, a request goes at once.
            loaded = bool(self._running) or self._recent_rows > 1.5
            taken = self._queue.take(now, may_wait=loaded, instance=instance.index)
            if taken is None:
                continue  # nothing this instance may run (the rest is pinned elsewhere)
            if isinstance(taken, float):
                self._fill_by = min(taken, self._fill_by or taken)
                continue
            self._running.add(instance)
            batch = self._launch(instance, taken, now)
            if batch is None:
                continue
            if inline is None and own is not None and all(j.payload.ticket is own for j in taken):
                inline = batch
            else:
                asyncio.create_task(self._finish(batch))
        return inline

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            self._pump()
            now = self._clock.now()
            timeout = self._sleep_for(now, self._fill_by, bool(self._free()))
            self._sleep_until = None if timeout is None else now + timeout
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _sleep_for(self, now: float, wake_at: float | None, any_free: bool) -> float | None:
        times = [t for t in (wake_at, self._queue.next_deadline()) if t is not None]
        if len(self._queue) and not any_free:
            times.append(now + _IDLE_POLL_S)
        if not times:
            return None
        # A hair past the deadline, so the job has expired when the loop looks again.
        return max(0.0, min(times) - now) + 0.0002

    def _expired(self, job: Job[_Work], now: float) -> None:
        waited = (now - job.arrival) * 1000
        self._metrics.shed.labels(self.name, job.cls.name, "deadline").inc()
        job.payload.ticket.fail(
            QueueDeadlineExceeded(
                f"request to model {self.name!r} waited {waited:.0f} ms in the queue, past its "
                f"deadline of {(job.deadline - job.arrival) * 1000:.0f} ms ({job.cls.name} class); "
                "it was not run. Hint: retry later, lower the load, or add instances"
            )
        )

    def _launch(self, instance: Instance, jobs: list[Job[_Work]], started: float) -> _Batch | None:
        """Send a batch to its instance now; None when nothing went (every caller gave up,
        or the worker is gone and the work was queued again or failed)."""
        jobs = [j for j in jobs if not j.payload.ticket.future.done()]
        handle = instance.handle
        assert handle is not None
        rows = [j.rows for j in jobs]
        batch = _Batch(instance, handle, jobs, rows, started)
        if not jobs:
            self._release(batch, pump=False)
            return None
        works = [j.payload for j in jobs]
        names = list(dict.fromkeys(n for w in works for n in w.ticket.outputs))
        try:
            batch.future = handle.begin(
                merge([w.inputs for w in works]), names, lambda: self._replied(batch)
            )
        except WorkerFailed as exc:
            self._retry_or_fail(jobs, instance, exc)
            self._release(batch, pump=False)  # the loop looks again; we may be inside a pump
            return None
        except Exception as exc:  # tensors the arena cannot take: a bug, but answer anyway
            log.exception("model %s: sending a batch failed", self.name)
            for w in works:
                w.ticket.fail(InfergateError(f"internal error: {type(exc).__name__}: {exc}"))
            self._release(batch, pump=False)
            return None
        return batch

    def _replied(self, batch: _Batch) -> None:
        """Runs in the pipe reader as soon as the reply is read: the instance takes its next
        batch before this one's callers are answered (answering a large batch keeps the
        event loop busy a while, and the worker would sit idle meanwhile)."""
        batch.replied = self._clock.now()
        self._release(batch)

    def _release(self, batch: _Batch, pump: bool = True) -> None:
        if batch.released:
            return
        batch.released = True
        self._running.discard(batch.instance)
        if pump:
            self._pump()
        self._wake.set()  # the loop plans its next look again

    async def _finish(self, batch: _Batch) -> None:
        """Await a launched batch and answer its callers."""
        assert batch.future is not None
        jobs, works = batch.jobs, [j.payload for j in batch.jobs]
        timeout = max(w.ticket.timeout_s for w in works)
        left = max(0.0, batch.started + timeout - self._clock.now())
        try:
            # Shielded: a caller that gives up must not cancel the batch's own reply.
            outputs = await batch.handle.wait(asyncio.shield(batch.future), left, timeout)
        except asyncio.CancelledError:
            if batch.future.done():
                self._release(batch)
            raise  # else the reply is still to come, and whoever awaits it releases it
        except WorkerFailed as exc:
            self._retry_or_fail(jobs, batch.instance, exc)  # queued again before the pump
            self._release(batch)
            return
        except InfergateError as exc:
            batch.future.cancel()  # past its timeout, the worker is killed: no reply comes
            for w in works:
                w.ticket.fail(exc)
            self._release(batch)
            return
        finally:
            self._orphans.discard(asyncio.current_task())
        self._release(batch)  # the reply has released it already, unless it came too late
        compute_s = (batch.replied or self._clock.now()) - batch.started
        try:
            pieces = unmerge(outputs, batch.rows) if len(works) > 1 else [outputs]
        except ValueError as exc:
            for w in works:
                w.ticket.fail(ModelExecutionError(str(exc)))
            return
        batch.instance.batches += 1
        size = sum(batch.rows)
        self._recent_rows = 0.8 * self._recent_rows + 0.2 * size
        self.stats.batch_done(size, compute_s)
        self._metrics.child(self._metrics.batch_size, self.name).observe(size)
        self._metrics.child(self._metrics.compute_seconds, self.name).observe(compute_s)
        queue_seconds = self._metrics.queue_seconds
        for job, work, piece in zip(jobs, works, pieces, strict=True):
            queue_s = batch.started - job.arrival
            self._metrics.child(queue_seconds, self.name, job.cls.name).observe(queue_s)
            wanted = work.ticket.outputs
            if tuple(piece) != wanted:  # others in the batch asked for more, or in another order
                piece = {n: piece[n] for n in wanted}
            work.ticket.part_done(work.index, piece, queue_s, compute_s)

    def _retry_or_fail(self, jobs: list[Job[_Work]], failed: Instance, exc: WorkerFailed) -> None:
        """Inference is idempotent: work on a worker that died gets one more try, on a
        sibling, when one is ready."""
        # A worker killed for its memory would take the sibling down the same way.
        sibling_ready = not isinstance(exc, WorkerOverMemory) and any(
            i.ready for i in self._instances if i is not failed
        )
        for job in jobs:
            if sibling_ready and not job.payload.retried and not job.payload.bound:
                job.payload.retried = True
                # It met its deadline once already: the retry gets a fresh one.
                now = self._clock.now()
                patience = job.deadline - job.arrival
                again = Job(
                    job.payload,
                    job.cls,
                    now,
                    now + patience,
                    job.rows,
                    job.key,
                    None,
                    job.fair,
                    job.group,
                )
                self._queue.admit([again], force=True)
                self._metrics.child(self._metrics.retries, self.name).inc()
            else:
                job.payload.ticket.fail(exc)
