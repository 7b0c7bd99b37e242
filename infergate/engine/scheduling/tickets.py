"""A request inside the scheduler: its ticket (the future its caller awaits, filled in as
its chunks come back) and the unit of work each chunk is queued as."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import NamedTuple

from infergate.engine.scheduling.batching import merge
from infergate.errors import InfergateError
from infergate.tensors import Array


class Timing(NamedTuple):
    """What a request went through: Triton's statistics read the first two, breakers the
    last (the model's latency: the longest batch it ran in)."""

    queue_s: float
    compute_s: float
    slowest_s: float


Answer = tuple[dict[str, Array], Timing]


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's answer, assembled from its chunks' outputs in order."""

    outputs: tuple[str, ...]
    timeout_s: float
    parts: int
    future: asyncio.Future[Answer]
    results: dict[int, dict[str, Array]] | None = None  # a chunked request's, by chunk
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
        results = self.results
        if results is None:
            results = self.results = {}
        results[index] = outputs
        self.queue_s = max(self.queue_s, queue_s)
        self.compute_s += compute_s
        self.slowest_s = max(self.slowest_s, compute_s)
        if len(results) == self.parts and not self.future.done():
            merged = merge([results[i] for i in range(self.parts)])
            self.future.set_result((merged, Timing(self.queue_s, self.compute_s, self.slowest_s)))


@dataclass(eq=False, slots=True)
class Work:
    """One chunk of a request (the whole request, usually), as the queue carries it."""

    ticket: Ticket
    index: int
    inputs: dict[str, Array]
    retried: bool = False  # it had its one more try (runner.py): it gets no other
    bound: bool = False  # a sequence's: it runs on its instance or not at all
    # Why its first run failed, while it waits to run again: what its caller learns if
    # the second run cannot start by its deadline.
    failed_with: InfergateError | None = None
