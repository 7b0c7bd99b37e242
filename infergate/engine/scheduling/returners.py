"""The callers of a model version's last batches, presumed on their way back.

Most clients send their next request once answered (a closed loop). When a batch of n
requests is answered and no other batch runs, n requests are about to arrive: a free
instance that took the first alone ran a batch of one, and cut short the batch filling
beside it when that one came back (at c=64 a quarter of the batches held one row). So a
part-full batch may also wait for them: while more are awaited than twice the instances,
and for at most the batching delay's share of them (max_delay_s / max_batch_size each: a
full batch's callers get the whole delay). Fewer could each run at once on an instance in
one or two batches: a pair or a trio of clients waiting for each other lost 7-15% of
their requests/s (benchmarks/concurrency_sweep.py), and a lone client never waits. Tiny
c=6 to c=64 gained 7-35% with it, fewer batches costing the gateway's loop less.

Once all the callers of such a round are back, a free instance no longer holds back for
the batch running beside it either: its callers come back only once it is answered, and
the round's last few would wait for them, every round on one instance while the other
idled (a model of c=40 on two instances: 61,000 against 77,000 requests/s).
"""

from __future__ import annotations


class Returners:
    __slots__ = ("_count", "_until", "_per_job", "_most_s", "_floor", "_round", "_all_back")

    def __init__(self, max_delay_s: float, max_batch_size: int, instances: int) -> None:
        self._per_job = max_delay_s / max(1, max_batch_size)
        self._most_s = max_delay_s
        self._floor = 2 * instances  # awaited beyond this many, a batch may wait for them
        self._count = 0  # requests answered and not yet followed by as many arrivals
        self._until = 0.0  # ...expected by then
        self._round = False  # more than the floor were awaited since the last answer
        self._all_back = False  # ...and as many have arrived since

    def answered(self, requests: int, now: float) -> None:
        """A batch answered `requests` callers at `now`."""
        if not requests:
            return
        if now >= self._until:
            self._count, self._until = 0, now
        self._count += requests
        self._until = min(self._until + requests * self._per_job, now + self._most_s)
        self._round = self._count > self._floor
        self._all_back = False

    def arrived(self) -> None:
        """A request arrived (whoever sent it: one fewer is awaited)."""
        if self._count:
            self._count -= 1
            if not self._count:
                self._all_back = self._round

    def requeued(self, requests: int) -> None:
        """Requests of an answered batch queued again (to run alone): not coming back."""
        self._count = max(0, self._count - requests)

    def hold(self, busy: bool, now: float) -> tuple[bool, float | None]:
        """Whether a part-full batch may wait to fill now, and until when at most (None:
        the queue's own limit, its oldest request's arrival + max_delay_s). `busy`: another
        batch of the version runs."""
        if busy:
            return not self._all_back, None
        if self._count > self._floor and now < self._until:
            return True, self._until
        return False, None
