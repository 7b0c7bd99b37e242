"""The queue of one model version, as pure logic on an injected clock (no asyncio, no
processes), so its promises are property-tested: classes in rank order; within a class,
tenants share fairly (start-time fair queuing, weighted by rows over the tenant's
`weight`), and each tenant's own jobs go in arrival order; nothing taken after its
deadline unless its request already started; batches of compatible jobs (an equal,
non-None key) up to `max_batch_size` rows, waiting at most `max_delay_s` for a batch to
fill; and, when full, shedding the lowest classes first, then the last job of the tenant
holding the most of the class's share of the queue, for a tenant that holds less.

Fair queuing: each job gets a virtual start tag, the later of its class's virtual time
(the tag of the last job taken) and its tenant's previous finish tag; its finish tag adds
rows / weight. Jobs go in tag order, so a tenant with a deep backlog has pushed its own
tags far ahead, and a tenant that sends one request lands at the front of the class.
A tenant that was idle gets no credit for it (its tag is never behind the class's).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from infergate.engine.scheduling.classes import PriorityClass
from infergate.errors import QueueFull as QueueFull  # raised here

T = TypeVar("T")


class Fairness(NamedTuple):
    """Whose request this is, for fair sharing within a class (a NamedTuple: one is made
    per request, and a frozen dataclass costs a setattr call per field)."""

    tenant: Hashable = None
    weight: float = 1.0  # a tenant of weight 2 gets twice the rows of one of weight 1


_NOBODY = Fairness()


@dataclass(eq=False, slots=True)
class Group:
    """The chunks of one request: once one has started, none of them expires."""

    started: bool = False


@dataclass(eq=False, slots=True)
class Job(Generic[T]):
    """A unit the queue schedules: a whole request, or one chunk of a large one."""

    payload: T
    cls: PriorityClass
    arrival: float
    deadline: float  # the latest time it may start; past it, it expires unrun
    rows: int = 1  # rows along the batch dimension
    key: Hashable = None  # jobs batch together only with an equal key; None runs alone
    pin: int | None = None  # the only instance that may run it (session affinity)
    fair: Fairness = _NOBODY  # (a shared default: a default_factory is a call a job)
    group: Group | None = None  # the request's other chunks, when it was cut up
    removed: bool = False
    # Given by the queue as it admits the job (`_push`), not by `__init__`: a field that
    # `__init__` sets costs every request.
    seq: int = field(init=False, repr=False)
    tag: float = field(init=False, repr=False)  # virtual start time, for fair queuing

    def order(self) -> tuple[int, float, float, int]:
        return (self.cls.rank, self.tag, self.deadline, self.seq)

    @property
    def expirable(self) -> bool:
        """A request that started is never expired: its later chunks run."""
        return self.group is None or not self.group.started


@dataclass(frozen=True)
class QueuePolicy:
    max_batch_size: int = 32  # rows per batch; 0 or 1: no batching
    max_delay_s: float = 0.002  # how long the oldest job may wait for a batch to fill
    max_queue_size: int = 1024  # jobs waiting, all classes together


class JobQueue(Generic[T]):
    def __init__(self, policy: QueuePolicy, wanted: Callable[[Job[T]], bool] | None = None) -> None:
        self.policy = policy
        # (Kept, not a property of the policy: asked several times a request.)
        self.batching = policy.max_batch_size > 1
        # Whether a job's caller still waits for it: one that gave up (its client left)
        # leaves the queue when `take` comes to it, not a batch later. A flood of
        # requests whose clients left queued thousands of such jobs, each taken alone
        # and the queue sorted again for each.
        self._wanted = wanted
        # Per class rank, in taking order; and all jobs by deadline, for expiry.
        self._heaps: dict[int, list[tuple[float, float, int, Job[T]]]] = {}
        self._in_order: list[list[tuple[float, float, int, Job[T]]]] = []  # by class rank
        self._deadlines: list[tuple[float, int, Job[T]]] = []
        self._vtime: dict[int, float] = {}  # per class: the tag of the last job taken
        self._finish: dict[tuple[int, Hashable], float] = {}  # (class, tenant): last finish
        self._seq = itertools.count()
        # Until then, a batch holds one tenant's jobs only: the breaker could not tell
        # whose rows made the batches tenants shared go wrong (`keep_tenants_apart`).
        self.apart_until = float("-inf")
        self._size = 0
        # Rows waiting per batch key, and jobs pinned to one instance: with these, `take`
        # answers "still filling" without sorting the queue (asked on nearly every
        # request under load).
        self._key_rows: dict[Hashable, int] = {}
        self._pinned = 0

    def __len__(self) -> int:
        return self._size

    def depth_by_class(self) -> dict[str, int]:
        depths: dict[str, int] = {}
        for heap in self._heaps.values():
            for *_, job in heap:
                if not job.removed:
                    depths[job.cls.name] = depths.get(job.cls.name, 0) + 1
        return depths

    def _push(self, job: Job[T]) -> None:
        job.seq = seq = next(self._seq)
        rank, fair, rows, deadline, key = job.cls.rank, job.fair, job.rows, job.deadline, job.key
        tenant = (rank, fair.tenant)
        job.tag = tag = max(self._vtime.get(rank, 0.0), self._finish.get(tenant, 0.0))
        self._finish[tenant] = tag + max(rows, 1) / fair.weight
        heap = self._heaps.get(rank)
        if heap is None:  # a class's first job: its heap made once, for good
            heap = self._heaps[rank] = []
            self._in_order = [self._heaps[r] for r in sorted(self._heaps)]
        heapq.heappush(heap, (tag, deadline, seq, job))
        heapq.heappush(self._deadlines, (deadline, seq, job))
        self._size += 1
        if key is not None:
            self._key_rows[key] = self._key_rows.get(key, 0) + rows
        if job.pin is not None:
            self._pinned += 1

    def _remove(self, job: Job[T]) -> None:
        job.removed = True  # lazily dropped from its heaps when it reaches the top
        self._size -= 1
        if job.key is not None:
            left = self._key_rows[job.key] - job.rows
            if left:
                self._key_rows[job.key] = left
            else:
                del self._key_rows[job.key]
        if job.pin is not None:
            self._pinned -= 1

    def _head(self) -> Job[T] | None:
        """The job `take` would look at first, when no job is pinned."""
        for heap in self._in_order:
            while heap and heap[0][3].removed:
                heapq.heappop(heap)
            if heap:
                return heap[0][3]
        return None

    def waiting(self) -> list[Job[T]]:
        """Every waiting job, in the order they would be taken."""
        return list(self._live())

    def _live(self) -> Iterator[Job[T]]:
        wanted = self._wanted
        for heap in self._in_order:
            while heap and heap[0][3].removed:
                heapq.heappop(heap)
            for *_, job in sorted(heap):
                if job.removed:
                    continue
                if wanted is not None and not wanted(job):
                    self._remove(job)
                    continue
                yield job

    def unpin(self, instance: int, which: Callable[[Job[T]], bool]) -> int:
        """Let the waiting jobs pinned to `instance` for which `which` holds run on any
        instance; how many there were."""
        freed = 0
        for job in self._live():
            if job.pin == instance and which(job):
                job.pin = None
                freed += 1
        self._pinned -= freed
        return freed

    def admit(self, jobs: list[Job[T]], force: bool = False) -> list[Job[T]]:
        """Queue `jobs` (all of one request, so one class); returns jobs shed for room.

        Raises QueueFull, changing nothing, when lower classes cannot make room.
        """
        need = self._size + len(jobs) - self.policy.max_queue_size
        victims: list[Job[T]] = []
        if need > 0 and not force:
            rank = jobs[0].cls.rank
            # A request that started keeps its chunks: shedding them would waste its work.
            lower = [j for j in self._live() if j.cls.rank > rank and j.expirable]
            # The least urgent go first: the lowest class, then the latest deadline.
            lower.sort(key=lambda j: (j.cls.rank, j.deadline, j.seq), reverse=True)
            victims = self._whole(lower[:need], lower)
            if len(victims) < need:
                victims += self._over_share(jobs, need - len(victims))
            for victim in victims:
                self._remove(victim)
        for job in jobs:
            self._push(job)
        return victims

    @staticmethod
    def _whole(victims: list[Job[T]], candidates: list[Job[T]]) -> list[Job[T]]:
        """`victims` with the other queued chunks of each request they cut: a request shed
        is failed whole, so none of its chunks may keep a place."""
        groups = {id(v.group) for v in victims if v.group is not None}
        if not groups:
            return victims
        chosen = {id(v) for v in victims}
        return victims + [j for j in candidates if id(j.group) in groups and id(j) not in chosen]

    def _over_share(self, jobs: list[Job[T]], need: int) -> list[Job[T]]:
        """`need` jobs of `jobs`' class to shed for them, each from the tenant that holds
        the most of the queue (weighted), while it holds more than the arriving tenant
        then will: a tenant's backlog cannot keep another's request out of a full queue,
        and cannot take the place back (nor shed its equal). Each is the last its tenant
        would run; a request cut into chunks goes whole, its queued chunks together, even
        once it started (else one large request could hold a full queue against the
        others). QueueFull when there are not that many."""
        rank, arriving = jobs[0].cls.rank, jobs[0].fair
        held: dict[Hashable, int] = {}  # jobs queued in the class, per tenant
        weights: dict[Hashable, float] = {}
        sheddable: dict[Hashable, list[Job[T]]] = {}  # in taking order
        for job in self._live():
            if job.cls.rank == rank:
                tenant = job.fair.tenant
                held[tenant] = held.get(tenant, 0) + 1
                weights[tenant] = job.fair.weight
                if tenant != arriving.tenant:
                    sheddable.setdefault(tenant, []).append(job)
        share = (held.get(arriving.tenant, 0) + len(jobs)) / arriving.weight
        victims: list[Job[T]] = []
        while len(victims) < need:
            tenant = max(
                (t for t in sheddable if sheddable[t]),
                key=lambda t: held[t] / weights[t],
                default=None,
            )
            if tenant is None or held[tenant] / weights[tenant] <= share:
                raise QueueFull
            victim = sheddable[tenant].pop()
            gone = [victim]
            if victim.group is not None:  # its sender gets one 503: no chunk of it stays
                left = sheddable[tenant]
                gone += [j for j in left if j.group is victim.group]
                sheddable[tenant] = [j for j in left if j.group is not victim.group]
            victims += gone
            held[tenant] -= len(gone)
        return victims

    def _prune_deadlines(self) -> None:
        heap = self._deadlines
        while heap:
            job = heap[0][2]
            # (`expirable`, inlined: every job passes here once or more)
            if not job.removed and (job.group is None or not job.group.started):
                return
            heapq.heappop(heap)

    def expire(self, now: float) -> list[Job[T]]:
        """Remove and return the jobs whose deadline has passed and that have not started."""
        expired = []
        heap = self._deadlines
        self._prune_deadlines()
        while heap and heap[0][0] < now:
            _, _, job = heapq.heappop(heap)
            if not job.removed and job.expirable:
                self._remove(job)
                expired.append(job)
            self._prune_deadlines()
        return expired

    def clear(self) -> list[Job[T]]:
        """Remove and return every waiting job, a started request's chunks too (which
        `expire` never takes): for when nothing will ever run them."""
        jobs = list(self._live())
        for job in jobs:
            self._remove(job)
        return jobs

    def next_deadline(self) -> float | None:
        """When the next job may expire (jobs that cannot expire are left out)."""
        self._prune_deadlines()
        return self._deadlines[0][0] if self._deadlines else None

    def filling_until(self, now: float) -> float | None:
        """Until when the batch at the head is still filling, or None: `take(now)`'s
        verdict when it may wait, asked without taking. It fills while fewer rows of its
        key wait than a batch holds, for up to max_delay_s (never past its deadline).
        Only for a queue that batches and holds no pinned job (else None)."""
        if not self.batching or self._pinned:
            return None
        head = self._head()
        if head is None or head.key is None:
            return None
        if self._key_rows[head.key] >= self.policy.max_batch_size:
            return None
        if head.group is not None and head.group.started:
            return None  # the rest of a request already running: its caller waits on it
        fill_by = min(head.arrival + self.policy.max_delay_s, head.deadline)
        return fill_by if now < fill_by else None

    def take(
        self, now: float, may_wait: bool = True, instance: int | None = None
    ) -> list[Job[T]] | float | None:
        """The next batch to run, or the time to look again (a batch is filling), or None.

        `may_wait` allows holding a part-full batch back for up to max_delay_s; the caller
        passes False when waiting cannot pay off (no requests are on their way to fill it:
        scheduling/returners.py). Call expire(now) first: take never returns a job past its
        deadline, unless its request started already.
        """
        if may_wait and self.batching and not self._pinned:
            if not self._size:
                return None
            fill_by = self.filling_until(now)
            if fill_by is not None:
                return fill_by
        if self._size == 1 and not self._pinned:
            # One job (a lone client's request): it is the whole batch, and the look above
            # has said whether it waits to fill; nothing to sort or merge.
            only = self._head()
            if only is None:
                return None
            batch = [only]
        else:
            taken = self._take_merged(now, may_wait, instance)
            if not isinstance(taken, list):
                return taken
            batch = taken
        head = batch[0]
        rank = head.cls.rank
        self._vtime[rank] = max(self._vtime.get(rank, 0.0), head.tag)
        for job in batch:
            self._remove(job)
            if job.group is not None:
                job.group.started = True
        return batch

    def _take_merged(
        self, now: float, may_wait: bool, instance: int | None
    ) -> list[Job[T]] | float | None:
        """`take`'s batch from a queue of several jobs, before they leave it."""
        live = (j for j in self._live() if j.pin is None or j.pin == instance)
        head = next(live, None)
        if head is None:
            return None
        batch = [head]
        # A None key (no free batch dimension, or batching off) never merges.
        if self.batching and head.key is not None and head.rows < self.policy.max_batch_size:
            rows = head.rows
            apart = now < self.apart_until
            for job in live:
                if (
                    job.key == head.key
                    and rows + job.rows <= self.policy.max_batch_size
                    and (not apart or job.fair.tenant == head.fair.tenant)
                ):
                    batch.append(job)
                    rows += job.rows
                    if rows == self.policy.max_batch_size:
                        break
            fill_by = min(head.arrival + self.policy.max_delay_s, head.deadline)
            # (Apart, a batch goes as it is: the wait for more was counted in every
            # tenant's rows, and each batch waited the whole delay.)
            started = head.group is not None and head.group.started  # (see filling_until)
            if (
                may_wait
                and not apart
                and not started
                and rows < self.policy.max_batch_size
                and now < fill_by
            ):
                return fill_by
        return batch
