"""The queue of one model version, as pure logic on an injected clock (no asyncio, no
processes), so its promises are property-tested: classes in rank order, earliest deadline
first within a class, nothing taken after its deadline, batches of compatible jobs up to
`max_batch_size` rows, waiting at most `max_delay_s` for a batch to fill, and shedding the
lowest classes first when full.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from infergate.engine.scheduling.classes import PriorityClass

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class Job(Generic[T]):
    """A unit the queue schedules: a whole request, or one chunk of a large one."""

    payload: T
    cls: PriorityClass
    arrival: float
    deadline: float  # the latest time it may start; past it, it expires unrun
    rows: int = 1  # rows along the batch dimension
    key: Hashable = None  # jobs batch together only with an equal key
    pin: int | None = None  # the only instance that may run it (session affinity)
    seq: int = field(default=0)
    removed: bool = field(default=False)

    def order(self) -> tuple[int, float, int]:
        return (self.cls.rank, self.deadline, self.seq)


class QueueFull(Exception):
    """No room, and nothing of a lower class to shed for it."""


@dataclass(frozen=True)
class QueuePolicy:
    max_batch_size: int = 32  # rows per batch; 0 or 1: no batching
    max_delay_s: float = 0.002  # how long the oldest job may wait for a batch to fill
    max_queue_size: int = 1024  # jobs waiting, all classes together


class JobQueue(Generic[T]):
    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self._heaps: dict[int, list[tuple[float, int, Job[T]]]] = {}
        self._seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def batching(self) -> bool:
        return self.policy.max_batch_size > 1

    def depth_by_class(self) -> dict[str, int]:
        depths: dict[str, int] = {}
        for heap in self._heaps.values():
            for _, _, job in heap:
                if not job.removed:
                    depths[job.cls.name] = depths.get(job.cls.name, 0) + 1
        return depths

    def _push(self, job: Job[T]) -> None:
        job.seq = next(self._seq)
        heapq.heappush(self._heaps.setdefault(job.cls.rank, []), (job.deadline, job.seq, job))
        self._size += 1

    def _remove(self, job: Job[T]) -> None:
        job.removed = True  # lazily dropped from its heap when it reaches the top
        self._size -= 1

    def waiting(self) -> list[Job[T]]:
        """Every waiting job, most urgent first."""
        return list(self._live())

    def _live(self) -> Iterator[Job[T]]:
        for rank in sorted(self._heaps):
            for _, _, job in sorted(self._heaps[rank]):
                if not job.removed:
                    yield job

    def admit(self, jobs: list[Job[T]], force: bool = False) -> list[Job[T]]:
        """Queue `jobs` (all of one request, so one class); returns jobs shed for room.

        Raises QueueFull, changing nothing, when lower classes cannot make room.
        """
        need = self._size + len(jobs) - self.policy.max_queue_size
        victims: list[Job[T]] = []
        if need > 0 and not force:
            rank = jobs[0].cls.rank
            lower = [j for j in self._live() if j.cls.rank > rank]
            # The least urgent go first: the lowest class, then the latest deadline.
            lower.sort(key=lambda j: (j.cls.rank, j.deadline, j.seq), reverse=True)
            if len(lower) < need:
                raise QueueFull
            victims = lower[:need]
            for victim in victims:
                self._remove(victim)
        for job in jobs:
            self._push(job)
        return victims

    def expire(self, now: float) -> list[Job[T]]:
        """Remove and return the jobs whose deadline has passed."""
        expired = []
        for heap in self._heaps.values():
            while heap and (heap[0][2].removed or heap[0][0] < now):
                _, _, job = heapq.heappop(heap)
                if not job.removed:
                    job.removed = True
                    self._size -= 1
                    expired.append(job)
        return expired

    def next_deadline(self) -> float | None:
        tops = [heap[0][0] for heap in self._heaps.values() if heap]
        return min(tops) if tops else None

    def take(
        self, now: float, may_wait: bool = True, instance: int | None = None
    ) -> list[Job[T]] | float | None:
        """The next batch to run, or the time to look again (a batch is filling), or None.

        `may_wait` allows holding a part-full batch back for up to max_delay_s; the caller
        passes False when waiting cannot pay off (nothing else is running, so no load is
        building up behind it). Call expire(now) first: take never returns a job past its
        deadline.
        """
        live = (j for j in self._live() if j.pin is None or j.pin == instance)
        head = next(live, None)
        if head is None:
            return None
        batch = [head]
        if self.batching and head.rows < self.policy.max_batch_size:
            rows = head.rows
            for job in live:
                if job.key == head.key and rows + job.rows <= self.policy.max_batch_size:
                    batch.append(job)
                    rows += job.rows
                    if rows == self.policy.max_batch_size:
                        break
            fill_by = min(head.arrival + self.policy.max_delay_s, head.deadline)
            if may_wait and rows < self.policy.max_batch_size and now < fill_by:
                return fill_by
        for job in batch:
            self._remove(job)
        return batch
