"""Running batches on instances: send a batch to its worker, await the reply, answer each
caller with its own rows, and give the work of a batch that failed one more try, alone.
It owns which instances are busy; the scheduler decides what runs next.

One tenant's request must not fail another's by sharing its batch. A batch that one
request's data broke (the model raised) runs again request by request; so does a batch
whose worker ran past its timeout or was killed for its memory, when it held more than one
request: alone, only the request that did it times out or is killed again. A worker that
died otherwise (a crash) gives each of its requests one more try, alone: a lone request's
on a sibling or, with none ready, on its own instance once restarted; where tenants are
named, a batch's of several on the instance it ended, once restarted, when they can wait
for it, since one of them may end a worker again and a sibling serves the other tenants.
Each request gets one such try at most (a hostile flood cannot loop), within a deadline of
its own.

Nor slow another's, or fail it, in the breaker's eyes: a batch that several tenants'
requests shared tells each caller, with its answer or its error, whose requests they were
(`Timing.shared`, `InfergateError.shared`), and the breaker counts its outcome for them
together, not for each as its own (breaker.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar

from infergate.clock import Clock
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.placement import here
from infergate.engine.scheduling.batching import merge, unmerge
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import Job, JobQueue
from infergate.engine.scheduling.returners import Returners
from infergate.engine.scheduling.tickets import Work
from infergate.engine.triton.stats import VersionStats
from infergate.engine.workers.protocol import Worker
from infergate.errors import (
    DataNotServable,
    DeadlineExceeded,
    InfergateError,
    ModelExecutionError,
    WorkerFailed,
    WorkerOverMemory,
)
from infergate.metrics import Metrics
from infergate.tensors import Array

log = logging.getLogger("infergate.scheduler")

_GONE = ("failed", "stopped")  # an instance in these states never runs a batch again
_TENANT = attrgetter("fair.tenant")  # a job's tenant, read in C (`_shared`)


# Told of the requests a batch answered that it counts (`Ticket.counted`): their tenants in
# the batch's order, the batch's latency, and the tenants that shared it when several.
ServedWell = Callable[[list[Hashable], float, frozenset[Hashable] | None], None]


def _pinned_to(instance: Instance, cpu: int) -> bool:
    placement = instance.placement
    return placement is not None and placement.cpus is not None and cpu in placement.cpus


@dataclass(eq=False, slots=True)
class Batch:
    """One batch on an instance, from leaving the queue to its callers' answers."""

    instance: Instance
    handle: Worker
    jobs: list[Job[Work]]
    works: list[Work]  # the jobs' payloads (made once: `finish` and `_answer` read them)
    rows: list[int]
    started: float  # when it left the queue
    future: asyncio.Future[dict[str, Array]] | None = None
    replied: float | None = None  # when the worker's reply was read
    released: bool = False
    killed: bool = False  # past its timeout: its worker is being killed


class BatchRunner:
    def __init__(
        self,
        name: str,
        instances: list[Instance],
        queue: JobQueue[Work],
        clock: Clock,
        metrics: Metrics,
        stats: VersionStats,
        on_free: Callable[[bool], None],
        returners: Returners | None = None,
        served_well: ServedWell | None = None,
        current_cpu: Callable[[], int | None] = here.current_cpu,
    ) -> None:
        self.name = name
        self.busy: set[Instance] = set()  # instances running a batch
        # Set when the scheduler stops: no loop is left to run what would be queued again.
        self.stopped = False
        self._instances = instances
        self._queue = queue
        self._clock = clock
        self._metrics = metrics
        self._stats = stats
        self._on_free = on_free  # an instance freed up: the scheduler looks again
        self._returners = returners  # told of each batch answered, before it frees up
        self._served_well = served_well  # the breaker's, for the requests a batch counts
        # Whether any request was cut into chunks: from then on a batch's callers are
        # counted job by job (a request's last chunk), else they are its jobs.
        self.chunked = False
        self._current_cpu = current_cpu
        # The event loop batches run on, set by the scheduler when its loop starts (kept:
        # in Python 3.11 asking asyncio for it is a getpid() system call).
        self.loop: asyncio.AbstractEventLoop

    def free(self) -> list[Instance]:
        """The instances that may take a batch now (busy first: a set lookup, where `ready`
        is a chain of properties, and under load one instance is usually busy)."""
        busy = self.busy
        return [i for i in self._instances if i not in busy and i.ready]

    def free_in_order(self) -> list[Instance]:
        """`free()`, the one to use first at the front. With none busy (a lone request:
        the gateway will wait for this batch), the one pinned to the core this loop runs
        on: the worker is woken on the core the gateway leaves idle, not on another that
        must be woken (placement/here.py). With batches running, the instances' own order:
        the same worker first, wherever the gateway runs (preferring the worker on the
        gateway's core then cost 6% more gateway CPU per request at c=64, and the one on
        the other core 17-20%: the workers' and the gateway's places kept changing)."""
        free = self.free()
        if len(free) > 1 and not self.busy and (cpu := self._current_cpu()) is not None:
            for index, instance in enumerate(free):
                if _pinned_to(instance, cpu):
                    if index:
                        free.insert(0, free.pop(index))
                    break
        return free

    def launch(self, instance: Instance, jobs: list[Job[Work]], started: float) -> Batch | None:
        """Send a batch to its instance now; None when nothing went (every caller gave up,
        or the worker is gone and the work was queued again or failed)."""
        self.busy.add(instance)
        jobs = [j for j in jobs if not j.payload.ticket.future.done()]
        handle = instance.handle
        assert handle is not None
        works = [j.payload for j in jobs]
        batch = Batch(instance, handle, jobs, works, [j.rows for j in jobs], started)
        if not jobs:
            self._release(batch, pump=False)
            return None
        # The outputs asked for, in order of asking; usually one tuple for the whole batch.
        wanted = {w.ticket.outputs for w in works}
        if len(wanted) == 1:
            names = list(dict.fromkeys(wanted.pop()))
        else:
            names = list(dict.fromkeys(n for w in works for n in w.ticket.outputs))
        try:
            batch.future = handle.begin(
                merge([w.inputs for w in works]), names, lambda: self._replied(batch)
            )
            instance.running = True
        except WorkerFailed as exc:
            self._again_or_fail(jobs, exc)
            self._release(batch, pump=False)  # the loop looks again; we may be inside a pump
            return None
        except Exception as exc:  # tensors the arena cannot take: a bug, but answer anyway
            log.exception("model %s: sending a batch failed", self.name)
            for w in works:
                w.ticket.fail(InfergateError(f"internal error: {type(exc).__name__}: {exc}"))
            self._release(batch, pump=False)
            return None
        return batch

    def _replied(self, batch: Batch) -> None:
        """Runs in the pipe reader as soon as the reply is read: the instance takes its next
        batch before this one's callers are answered (answering a large batch keeps the
        event loop busy a while, and the worker would sit idle meanwhile)."""
        batch.replied = self._clock.now()
        if self._returners is not None:
            jobs = batch.jobs
            self._returners.answered(_callers(jobs) if self.chunked else len(jobs), batch.replied)
        if not batch.killed:  # (a reply that beat the kill: the instance waits for the exit)
            self._release(batch)

    def _release(self, batch: Batch, pump: bool = True) -> None:
        if batch.released:
            return
        batch.released = True
        batch.instance.running = False
        self.busy.discard(batch.instance)
        self._on_free(pump)

    async def finish(self, batch: Batch) -> None:
        """Await a launched batch and answer its callers."""
        assert batch.future is not None
        jobs, works = batch.jobs, batch.works
        timeout = max([w.ticket.timeout_s for w in works])
        left = max(0.0, batch.started + timeout - self._clock.now())
        try:
            # A caller that gives up does not cancel the batch's own reply (see `wait`).
            outputs = await batch.handle.wait(batch.future, left, timeout)
        except asyncio.CancelledError:
            if batch.future.done():
                self._release(batch)
            else:  # its worker's death, if that is how it ends, is nobody's to read now
                batch.future.add_done_callback(_read_quietly)
            raise  # else the reply is still to come, and whoever awaits it releases it
        except WorkerFailed as exc:  # it died, or was killed for its memory
            self._again_or_fail(jobs, exc, batch.instance)  # queued again before the pump
            self._release(batch)
            return
        except (DataNotServable, ModelExecutionError) as exc:
            # One request's data broke the batch (the model raised on it, the worker is
            # fine): the others must not fail with it, whoever sent them.
            self._alone_or_fail(jobs, exc)  # queued again before the pump
            self._release(batch)
            return
        except DeadlineExceeded as exc:
            batch.future.cancel()  # past its timeout, the worker is killed: no reply comes
            batch.killed = True
            self._again_or_fail(jobs, exc, batch.instance)
            # The instance takes nothing more until that worker is gone (it is alive until
            # the kill lands, and what went to it would fail with it); a sibling may.
            self._release_when_gone(batch)
            self._on_free(True)
            return
        except InfergateError as exc:
            batch.future.cancel()
            exc = _of_batch(exc, jobs)
            for w in works:
                w.ticket.fail(exc)
            self._release(batch)
            return
        self._release(batch)  # the reply has released it already, unless it came too late
        self._answer(batch, outputs)

    def _release_when_gone(self, batch: Batch) -> None:
        exited = batch.handle.exited
        if exited.done():
            self._release(batch)
        else:
            exited.add_done_callback(lambda _: self._release(batch))

    def _answer(self, batch: Batch, outputs: dict[str, Array]) -> None:
        """Give each caller its own rows of the batch's outputs, and count the batch."""
        jobs, works = batch.jobs, batch.works
        compute_s = (batch.replied or self._clock.now()) - batch.started
        shared = None  # the tenants whose requests it held, when several (breaker.py)
        try:
            if len(works) > 1:
                pieces = unmerge(outputs, batch.rows)
                shared = _shared(jobs)
            else:
                pieces = [outputs]
        except ValueError as exc:
            # Its outputs do not split back into the requests' rows (a model that does not
            # keep rows apart): each request runs again alone, so none gets another's rows
            # and one whose own output is odd does not fail the others.
            self._alone_or_fail(jobs, ModelExecutionError(str(exc)))
            return
        batch.instance.batches += 1
        counted: list[Job[Work]] = []  # the requests whose success this batch counts
        for job, work, piece in zip(jobs, works, pieces, strict=True):
            ticket = work.ticket
            wanted = ticket.outputs
            if tuple(piece) != wanted:  # others in the batch asked for more, or in another order
                piece = {n: piece[n] for n in wanted}
            if ticket.counted and not ticket.future.done():  # (done: its caller gave up)
                counted.append(job)
            ticket.part_done(work.index, piece, batch.started - job.arrival, compute_s, shared)
        if counted:  # before its callers resume: they find their success counted
            self._count_served(batch, compute_s, counted, shared)
        # Counted after the callers' answers are written (call_soon runs after the task
        # steps that part_done woke, or after this one when a caller awaits inline): a
        # lone client's answer does not wait for the batch's metrics.
        self.loop.call_soon(self._count, batch, compute_s)

    def _count_served(
        self,
        batch: Batch,
        compute_s: float,
        counted: list[Job[Work]],
        shared: frozenset[Hashable] | None,
    ) -> None:
        """The success of the requests `counted` (`Ticket.counted`), once for all: in
        Triton's statistics (answered now, each since it arrived) and for the breaker."""
        arrivals = sum(j.arrival for j in counted)
        n = len(counted)
        total_s = n * self._clock.now() - arrivals
        self._stats.requests_done(n, total_s, n * batch.started - arrivals, n * compute_s)
        if self._served_well is not None:
            self._served_well([j.fair.tenant for j in counted], compute_s, shared)

    def _count(self, batch: Batch, compute_s: float) -> None:
        size = sum(batch.rows)
        self._stats.batch_done(size, compute_s)
        metrics, name = self._metrics, self.name
        metrics.child(metrics.batch_size, name).observe(size)
        metrics.child(metrics.compute_seconds, name).observe(compute_s)
        queue_seconds, started = metrics.queue_seconds, batch.started
        cls: PriorityClass | None = None
        series: Any = None  # the class's child, found once a run of jobs of one class
        for job in batch.jobs:
            if job.cls is not cls:  # (a batch's jobs are usually of one class)
                cls = job.cls
                series = metrics.child(queue_seconds, name, cls.name)
            series.observe(started - job.arrival)

    def _alone_or_fail(self, jobs: list[Job[Work]], exc: InfergateError) -> None:
        """A batch that one request's data broke (the model raised, or cannot serve it):
        each of its requests queued again to run alone, so that the others are answered
        as if it had not been there and only its sender gets the error (400, 500); a
        request that ran alone gets it."""
        if len(jobs) == 1 or self.stopped:
            exc = _of_batch(exc, jobs)
            for job in jobs:
                job.payload.ticket.fail(exc)
            return
        now = self._clock.now()
        again = [
            Job(
                j.payload,
                j.cls,
                now,
                now + j.deadline - j.arrival,
                j.rows,
                None,
                j.pin,
                j.fair,
                j.group,
            )
            for j in jobs
        ]
        for job in again:  # run again: counted by Engine.finish, from its first start
            job.payload.ticket.counted = False
        self._queue.admit(again, force=True)
        if self._returners is not None:  # counted as answered when the reply came
            self._returners.requeued(_callers(again) if self.chunked else len(again))
        self._on_free(True)  # (the reply freed the instance, and the loop looked, before)

    def _again_or_fail(
        self, jobs: list[Job[Work]], exc: InfergateError, ended: Instance | None = None
    ) -> None:
        """A batch whose worker died, was killed for its memory, or ran past its timeout
        (and was killed). Inference is idempotent: its requests get one more try, each
        alone. A lone request's runs on a sibling or, with none ready, on the instance
        once it is restarted. A batch of several held a request that may end a worker
        again (poison data, a slow or large input), and with tenants named, a sibling's
        work is other tenants': each whose patience covers the restart (`back_in_s`) runs
        on the instance they ended, once it is back, until the request that ends it again
        alone is found (then the others may go anywhere: `may_move`), or that instance
        fails for good (`Scheduler._instance_failed`). One that cannot wait so long takes
        a sibling, as with no tenant named (nobody to keep from anybody): failing an
        innocent request to spare a worker's restart would be the worse trade.
        After a crash every request gets it (a lone one too): chance, or its data, ended
        the worker. Memory and time are what the batch took: a lone request took them
        itself and gets the error, while the requests of a batch of several run again
        alone so that only the one that took them fails (its lone run is killed again).

        Once only, and never for a sequence's request (bound to its instance) or once
        the scheduler stopped or no instance is left that could come back. The try gets a
        fresh queue deadline of the patience it came with, as its first run did (the
        first run's deadline was to start, and it started; its execution timeout counts
        anew from its start): it waits that long for an instance (a restart, with none
        other), and past it the caller gets the first run's error (scheduler._expired).
        A failed instance, or a stopped version, fails it at once (scheduler.py).

        `ended`: the instance whose worker this batch's run ended (None: the batch never
        reached it). A lone request that ended it is a query of death for its tenant
        (`Instance.on_ended_by`, the version's breaker): counted against it, and it is not
        run again where its tenant would be cut off for it or ended another worker
        within the window (it would end a sibling too)."""
        lone = all(j.payload.ticket is jobs[0].payload.ticket for j in jobs)
        exc = _of_batch(exc, jobs)  # what fails of it now, or later (`failed_with`)
        # A lone request's own memory or time: running it again would only do it again.
        again = not lone or not isinstance(exc, (WorkerOverMemory, DeadlineExceeded))
        if ended is not None and lone and jobs and not self.stopped:
            again = ended.on_ended_by(jobs[0].fair.tenant, _how(exc)) and again
        if again and (self.stopped or all(i.state in _GONE for i in self._instances)):
            again = False
        stay = None  # the instance a retry of this batch waits for, when it can
        back_in = 0.0
        if ended is not None and not self.stopped:
            if not lone and ended.state not in _GONE and _named(jobs):
                stay, back_in = ended.index, ended.back_in_s()
            elif lone and jobs[0].pin == ended.index and may_move(jobs[0]):
                # A retry held for this instance ended it again, alone: the request that
                # does it is found, and the others held for it may run anywhere.
                self._queue.unpin(ended.index, may_move)
        now = self._clock.now()
        retried = 0
        for job in jobs:
            work = job.payload
            if work.ticket.future.done():
                continue  # its caller gave up, or another chunk failed it
            if not again or work.retried or work.bound:
                work.ticket.fail(exc)
                continue
            work.failed_with = exc  # (so it is `retried`)
            work.ticket.counted = False  # run again: counted by Engine.finish, from its start
            patience = job.deadline - job.arrival
            where = stay if patience >= back_in else None  # (None: whichever is free first)
            alone = Job(
                work,
                job.cls,
                now,
                now + patience,
                job.rows,
                None,  # alone
                where,
                job.fair,
                job.group,
            )
            self._queue.admit([alone], force=True)
            retried += 1
        if retried:
            self._metrics.child(self._metrics.retries, self.name).inc(retried)


def may_move(job: Job[Work]) -> bool:
    """Whether a waiting `job` may leave the instance it is pinned to for another: a
    retry's may (a sequence's is bound to its instance's state; a session's keeps to its
    instance while that one can come back)."""
    return job.payload.retried and not job.payload.bound


def _named(jobs: list[Job[Work]]) -> bool:
    """Whether `jobs` name a tenant (with none configured, none does)."""
    return any(job.fair.tenant is not None for job in jobs)


def _shared(jobs: list[Job[Work]]) -> frozenset[Hashable] | None:
    """The tenants whose requests the batch of `jobs` held, when they were several."""
    tenants = frozenset(map(_TENANT, jobs))
    return tenants if len(tenants) > 1 else None


E = TypeVar("E", bound=InfergateError)


def _of_batch(exc: E, jobs: list[Job[Work]]) -> E:
    """`exc` as the requests of the batch of `jobs` get it: where several tenants' requests
    shared the batch, a copy that names them (an error may be given to more than one
    batch: a worker's death fails every call it had)."""
    shared = _shared(jobs) if len(jobs) > 1 else None
    if shared is None:
        return exc
    copy = type(exc).__new__(type(exc), *exc.args)
    copy.__dict__.update(exc.__dict__)
    copy.__cause__, copy.__context__ = exc.__cause__, exc.__context__
    copy.__suppress_context__ = exc.__suppress_context__  # (setting __cause__ set it)
    copy.shared = shared
    return copy.with_traceback(exc.__traceback__)


def _how(exc: InfergateError) -> str:
    """What ended a worker, in a few words (a breaker's reason quotes it)."""
    if isinstance(exc, WorkerOverMemory):
        return "was killed for its memory"
    if isinstance(exc, DeadlineExceeded):
        return "ran past the model's timeout and was killed"
    return "crashed"


def _read_quietly(future: asyncio.Future[Any]) -> None:
    """Read a batch's outcome that no caller awaits any more, so that asyncio does not
    log it as "never retrieved" when the future is collected."""
    if not future.cancelled():
        future.exception()


def _callers(jobs: list[Job[Work]]) -> int:
    """The requests whose last job is among `jobs` (a chunked request's earlier chunks
    answer nobody yet)."""
    return sum(1 for j in jobs if j.payload.index == j.payload.ticket.parts - 1)
