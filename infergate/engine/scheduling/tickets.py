"""A request inside the scheduler: its ticket (the future its caller awaits, filled in as
its chunks come back) and the unit of work each chunk is queued as."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from infergate.engine.scheduling.batching import merge
from infergate.errors import InfergateError
from infergate.tensors import Array


class Timing(NamedTuple):
    """What a request went through: Triton's statistics read the first two, breakers the
    rest (the model's latency: the longest batch it ran in; and the tenants whose requests
    shared a batch with it, when there were several: breaker.py). `counted`: its batch
    counted its success for both already (`Ticket.counted`)."""

    queue_s: float
    compute_s: float
    slowest_s: float
    shared: frozenset[Hashable] | None = None
    counted: bool = False


Answer = tuple[dict[str, Array], Timing]


@dataclass(eq=False, slots=True)
class _Chunks:
    """What a chunked request's answered chunks gave so far (made with the first: a field
    that `Ticket.__init__` sets costs every request, and most are one chunk)."""

    results: dict[int, dict[str, Array]] = field(default_factory=dict)  # by chunk
    queue_s: float = 0.0
    compute_s: float = 0.0
    slowest_s: float = 0.0
    shared: frozenset[Hashable] | None = None  # the tenants that shared its batches


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's answer, assembled from its chunks' outputs in order."""

    outputs: tuple[str, ...]
    timeout_s: float
    parts: int
    future: asyncio.Future[Answer]
    # Whether the batch that answers it counts its success for the breaker and the
    # statistics, once for all its requests (runner.py): a request the breaker admitted
    # as a normal one, in one piece, in one run. (A probe's outcome is judged on its own;
    # a chunked request's latency is its slowest chunk's; one run again after its batch
    # failed is timed from its first start, which its new job no longer holds.)
    counted: bool = False
    chunks: _Chunks | None = None  # a chunked request's, from its first chunk's answer

    def fail(self, error: InfergateError) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def part_done(
        self,
        index: int,
        outputs: dict[str, Array],
        queue_s: float,
        compute_s: float,
        shared: frozenset[Hashable] | None = None,
    ) -> None:
        """Chunk `index` answered, after `queue_s` in the queue, in a batch that took
        `compute_s` (and that `shared` tenants' requests shared, when several)."""
        if self.parts == 1:  # the usual case: the whole request ran in one batch
            if not self.future.done():
                timing = Timing(queue_s, compute_s, compute_s, shared, self.counted)
                self.future.set_result((outputs, timing))
            return
        chunks = self.chunks
        if chunks is None:
            chunks = self.chunks = _Chunks(shared=shared)
        elif shared is not None:
            chunks.shared = shared if chunks.shared is None else chunks.shared | shared
        results = chunks.results
        results[index] = outputs
        chunks.queue_s = max(chunks.queue_s, queue_s)
        chunks.compute_s += compute_s
        chunks.slowest_s = max(chunks.slowest_s, compute_s)
        if len(results) == self.parts and not self.future.done():
            merged = merge([results[i] for i in range(self.parts)])
            timing = Timing(chunks.queue_s, chunks.compute_s, chunks.slowest_s, chunks.shared)
            self.future.set_result((merged, timing))


@dataclass(eq=False, slots=True)
class Work:
    """One chunk of a request (the whole request, usually), as the queue carries it."""

    ticket: Ticket
    index: int
    inputs: dict[str, Array]
    bound: bool = False  # a sequence's: it runs on its instance or not at all
    # Why its first run failed, while it waits to run again: what its caller learns if
    # the second run cannot start by its deadline.
    failed_with: InfergateError | None = None

    @property
    def retried(self) -> bool:
        """It had its one more try (runner.py): it gets no other. (Read from `failed_with`,
        which the try sets: one field fewer for `__init__` to set on every request.)"""
        return self.failed_with is not None
