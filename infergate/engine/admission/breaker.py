"""Circuit breakers per model version, on an injected clock.

Outcomes and latencies go into a sliding window of time buckets. Every bucket's length an
evaluation asks: over the window, is the failure rate above `failure_rate` (once there are
`min_requests`), or the p99 above `latency_p99_ms`? `consecutive_windows` such answers in a
row open the breaker. Open: requests are refused (503 with Retry-After) for a backoff that
doubles on each reopening up to `backoff_max_s`. Then half-open: `probes` requests go
through; if they all succeed the breaker closes (and the backoff resets), one failure
reopens it.

    closed --(bad for N evaluations)--> open --(backoff)--> half_open
       ^                                  ^                     |
       +----------(probes succeed)--------+----(a probe fails)--+

The window's cost does not grow with the traffic: the latency verdict counts, in each
bucket, the latencies measured and those above `latency_p99_ms` (the p99 is above the
limit exactly when more than 1% of them are), and keeps a uniform sample of at most
`SAMPLES` latencies a bucket for the p99 it shows (all of them, below that). Keeping every
latency, as it did, held 60 s of traffic (700,000 floats at 12,000 requests/s) and sorted
them all at each evaluation, stalling the event loop for a tenth of a second every 6 s.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from infergate.clock import Clock

State = Literal["closed", "open", "half_open"]
Admission = Literal["refused", "normal", "probe"]


@dataclass(frozen=True)
class BreakerPolicy:
    # Each setting's bounds and meaning: infergate/settings/profile_sections.py (BreakerSection).
    window_seconds: float = 60.0
    failure_rate: float = 0.05
    latency_p99_ms: float = 1500.0
    consecutive_windows: int = 3
    min_requests: int = 20
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    probes: int = 3
    buckets: int = 10  # an implementation detail: no setting declares it


SAMPLES = 1024  # latencies a bucket keeps for the p99 it shows (the verdict counts all)


@dataclass(slots=True)
class _Bucket:
    start: float
    ok: int = 0
    failed: int = 0
    measured: int = 0  # latencies recorded
    slow: int = 0  # of them, above the limit in force when recorded
    latencies: list[float] = field(default_factory=list)  # a uniform sample of SAMPLES
    weight: float = 0.0  # the reservoir's state, once full: see Breaker.record
    next_kept: int = 0


class Breaker:
    def __init__(
        self,
        policy: BreakerPolicy,
        clock: Clock,
        on_change: Callable[[State, str], None] | None = None,
    ) -> None:
        self.policy = policy
        self._on_change = on_change
        self._clock = clock
        self._state: State = "closed"
        self.reason = ""
        self._buckets: deque[_Bucket] = deque()
        self._bad_evaluations = 0
        self._bucket_s = policy.window_seconds / policy.buckets
        self._next_evaluation = clock.now() + self._bucket_s
        self._open_until = 0.0
        self._backoff = policy.backoff_initial_s
        self._probes_left = 0
        self._probes_ok = 0
        self._limit_s = policy.latency_p99_ms / 1000
        self._random = random.Random(0)  # which latencies a full bucket keeps

    @property
    def state(self) -> State:
        self._tick()
        return self._state

    def reconfigure(self, policy: BreakerPolicy) -> None:
        """A new policy; latencies already counted stay counted against the limit in force
        when they came, so a new `latency_p99_ms` fully applies one window later."""
        self.policy = policy
        self._limit_s = policy.latency_p99_ms / 1000
        self._bucket_s = policy.window_seconds / policy.buckets
        self._backoff = min(self._backoff, policy.backoff_max_s)

    def _move(self, state: State, reason: str) -> None:
        self._state, self.reason = state, reason
        if self._on_change is not None:
            self._on_change(state, reason)

    def retry_after(self) -> float:
        return max(0.0, self._open_until - self._clock.now())

    def allow(self) -> Admission:
        """May a request go through now? In half-open, the few let through are probes."""
        if self._state != "closed" or self._clock.now() >= self._next_evaluation:
            self._tick()  # (closed, before its next evaluation: nothing to do)
        if self._state == "closed":
            return "normal"
        if self._state == "half_open" and self._probes_left > 0:
            self._probes_left -= 1
            return "probe"
        return "refused"

    def record(self, admission: Admission, ok: bool, latency_s: float | None) -> None:
        """The outcome of a request that `allow` let through as `admission`, with the
        model's execution latency (None: not measured, e.g. the worker died)."""
        now = self._clock.now()
        if now >= self._next_evaluation or self._state != "closed":  # else _tick has nothing to do
            self._tick(now)
        if admission == "probe":
            if self._state != "half_open":
                return
            if not ok:
                self._open(f"a probe failed ({self.reason})")
                return
            self._probes_ok += 1
            if self._probes_ok >= self.policy.probes:
                self._close()
            return
        if self._state != "closed":
            return  # a request from before the breaker opened
        buckets = self._buckets
        if buckets and now < buckets[-1].start + self._bucket_s:  # `_current`, inline
            bucket = buckets[-1]
        else:
            bucket = self._current(now)
        if ok:
            bucket.ok += 1
        else:
            bucket.failed += 1
        if latency_s is not None:
            bucket.measured += 1
            if latency_s > self._limit_s:
                bucket.slow += 1
            if bucket.measured <= SAMPLES:
                bucket.latencies.append(latency_s)
                if bucket.measured == SAMPLES:
                    bucket.weight = math.exp(math.log(self._uniform()) / SAMPLES)
                    bucket.next_kept = SAMPLES + self._skip(bucket.weight)
            elif bucket.measured == bucket.next_kept:
                # Reservoir sampling (Li's algorithm L): every latency of the bucket is kept
                # with the same chance, and only the kept ones draw random numbers.
                bucket.latencies[int(self._random.random() * SAMPLES)] = latency_s
                bucket.weight *= math.exp(math.log(self._uniform()) / SAMPLES)
                bucket.next_kept += self._skip(bucket.weight)

    def _uniform(self) -> float:
        """A random number in (0, 1)."""
        return self._random.random() or 0.5

    def _skip(self, weight: float) -> int:
        """How many latencies on the next one a full bucket keeps (algorithm L)."""
        return int(math.log(self._uniform()) / math.log(1.0 - weight)) + 1

    def reset(self) -> None:
        self._buckets.clear()
        self._backoff = self.policy.backoff_initial_s
        self._bad_evaluations = 0
        self._move("closed", "reset by an operator")

    def _current(self, now: float) -> _Bucket:
        if not self._buckets or now >= self._buckets[-1].start + self._bucket_s:
            self._buckets.append(_Bucket(now))
        return self._buckets[-1]

    def _tick(self, now: float | None = None) -> None:
        if now is None:
            now = self._clock.now()
        if self._state == "open" and now >= self._open_until:
            self._move("half_open", self.reason)
            self._probes_left = self.policy.probes
            self._probes_ok = 0
        while now >= self._next_evaluation:
            at = self._next_evaluation
            self._next_evaluation += self._bucket_s
            if self._state == "closed":
                self._evaluate(at)

    def window_stats(self, now: float | None = None) -> tuple[int, int, float | None]:
        """Requests, failures and p99 latency (seconds) in the window ending `now`; the
        p99 is None when no request in it had its latency measured, and is read from the
        buckets' samples: exact up to SAMPLES latencies a bucket."""
        now = self._clock.now() if now is None else now
        while self._buckets and self._buckets[0].start <= now - self.policy.window_seconds:
            self._buckets.popleft()
        ok = sum(b.ok for b in self._buckets)
        failed = sum(b.failed for b in self._buckets)
        latencies = sorted(x for b in self._buckets for x in b.latencies)
        return ok + failed, failed, _p99(latencies)

    def _too_slow(self) -> tuple[int, int] | None:
        """The window's (slow, measured) latencies when its p99 is above the limit, else
        None: sorted, the latency at the p99's place is above the limit exactly when at
        least that many from the top are."""
        measured = sum(b.measured for b in self._buckets)
        slow = sum(b.slow for b in self._buckets)
        if measured and slow >= measured - min(measured - 1, int(0.99 * measured)):
            return slow, measured
        return None

    def _evaluate(self, now: float) -> None:
        total, failed, p99 = self.window_stats(now)
        why = ""
        limit_ms = self.policy.latency_p99_ms
        if total >= self.policy.min_requests:
            if failed / total > self.policy.failure_rate:
                why = (
                    f"failure rate {failed / total:.0%} over {total} requests "
                    f"(limit {self.policy.failure_rate:.0%})"
                )
            elif (slow := self._too_slow()) is not None:
                if p99 is not None and p99 * 1000 > limit_ms:
                    why = f"p99 latency {p99 * 1000:.0f} ms (limit {limit_ms:.0f} ms)"
                else:  # the sample missed the slow ones (a bucket of more than SAMPLES)
                    why = f"p99 latency above {limit_ms:.0f} ms ({slow[0]} of {slow[1]} slower)"
        self._bad_evaluations = self._bad_evaluations + 1 if why else 0
        if why and self._bad_evaluations >= self.policy.consecutive_windows:
            self._open(why)

    def _open(self, why: str) -> None:
        if self._state == "half_open":
            self._backoff = min(self._backoff * 2, self.policy.backoff_max_s)
        self._open_until = self._clock.now() + self._backoff
        self._bad_evaluations = 0
        self._buckets.clear()
        self._move("open", why)

    def _close(self) -> None:
        self._backoff = self.policy.backoff_initial_s
        self._buckets.clear()
        self._move("closed", "probes succeeded")


def _p99(ordered: list[float]) -> float | None:
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None
