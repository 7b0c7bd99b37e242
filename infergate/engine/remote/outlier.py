"""Outlier detection with Envoy's meanings (envoy.config.cluster.v3.OutlierDetection):

- `consecutive_5xx` (5) answers in a row that are 5xx, or connection failures, eject an
  endpoint at once (a success resets the count).
- It stays out for `base_ejection_time` (30 s) times the number of times it has been
  ejected, capped at `max_ejection_time` (300 s).
- Every `interval` (10 s) a sweep returns endpoints whose time is up, and lowers the
  ejection count of each endpoint that is in service (so a host that behaves for a while
  is judged afresh).
- No more than `max_ejection_percent` (10%) of the endpoints are out at once, but at
  least one may be, whatever the percentage (Envoy's rule since 1.x).

Time comes from the injected clock: `sweep` runs whenever a caller asks and an interval
has passed, so tests advance a FakeClock instead of sleeping.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from infergate.clock import Clock


@dataclass
class OutlierState:
    consecutive_5xx: int = 0
    ejections: int = 0  # Envoy's ejection multiplier
    ejected_until: float | None = None  # None: in service

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None


@dataclass(frozen=True)
class OutlierPolicy:
    consecutive_5xx: int = 5
    interval_s: float = 10.0
    base_ejection_time_s: float = 30.0
    max_ejection_time_s: float = 300.0
    max_ejection_percent: float = 10.0


class OutlierDetector:
    def __init__(
        self,
        endpoints: list[str],
        policy: OutlierPolicy,
        clock: Clock,
        on_change: Callable[[str, bool, str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.states = {e: OutlierState() for e in endpoints}
        self._clock = clock
        self._next_sweep = clock.now() + policy.interval_s
        self._on_change = on_change or (lambda endpoint, ejected, why: None)

    def max_ejected(self) -> int:
        share = math.floor(len(self.states) * self.policy.max_ejection_percent / 100)
        return max(1, share)

    def ejected_count(self) -> int:
        return sum(1 for s in self.states.values() if s.ejected)

    def is_ejected(self, endpoint: str) -> bool:
        self.maybe_sweep()
        return self.states[endpoint].ejected

    def success(self, endpoint: str) -> None:
        self.states[endpoint].consecutive_5xx = 0

    def failure(self, endpoint: str) -> None:
        """A 5xx answer or a connection failure (Envoy counts local-origin errors as 5xx
        unless told to split them)."""
        self.maybe_sweep()
        state = self.states[endpoint]
        state.consecutive_5xx += 1
        if state.consecutive_5xx < self.policy.consecutive_5xx or state.ejected:
            return
        if self.ejected_count() >= self.max_ejected():
            return  # over max_ejection_percent: it stays in, its count keeps growing
        state.ejections += 1
        state.consecutive_5xx = 0
        out_for = min(
            self.policy.base_ejection_time_s * state.ejections,
            max(self.policy.max_ejection_time_s, self.policy.base_ejection_time_s),
        )
        state.ejected_until = self._clock.now() + out_for
        self._on_change(
            endpoint,
            True,
            f"{self.policy.consecutive_5xx} consecutive 5xx or connection failures; "
            f"ejected for {out_for:g} s (ejection {state.ejections})",
        )

    def maybe_sweep(self) -> None:
        now = self._clock.now()
        if now < self._next_sweep:
            return
        # Sweeps happen on interval boundaries, however late someone looks: the last one
        # due is judged at its own time, and each missed one lowers the multipliers.
        missed = math.floor((now - self._next_sweep) / self.policy.interval_s)
        sweep_at = self._next_sweep + missed * self.policy.interval_s
        self._next_sweep = sweep_at + self.policy.interval_s
        for endpoint, state in self.states.items():
            if state.ejected_until is not None:
                if sweep_at >= state.ejected_until:
                    state.ejected_until = None
                    state.consecutive_5xx = 0
                    self._on_change(endpoint, False, "ejection time passed; back in service")
            elif state.ejections > 0:
                state.ejections = max(0, state.ejections - (missed + 1))
