"""Choosing an endpoint: least request with the power of two choices (Envoy's
LEAST_REQUEST with choice_count 2), over the endpoints that are healthy and not ejected.
When none is, all of them are candidates again (Envoy's panic mode): a guess beats
refusing every request while the checks catch up.

The retry budget is Envoy's: retries in flight may be at most `budget_percent` of the
requests in flight, but `min_retry_concurrency` are always allowed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection

from infergate.engine.remote.health import HealthChecks
from infergate.engine.remote.outlier import OutlierDetector


class Balancer:
    def __init__(
        self,
        endpoints: list[str],
        health: HealthChecks,
        outliers: OutlierDetector,
        rng: random.Random | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.active = dict.fromkeys(endpoints, 0)  # requests in flight on each
        self.sent = dict.fromkeys(endpoints, 0)  # requests sent to each, ever
        self._health = health
        self._outliers = outliers
        self._rng = rng or random.Random()

    def available(self, endpoint: str) -> bool:
        return self._health.is_healthy(endpoint) and not self._outliers.is_ejected(endpoint)

    def pick(self, exclude: Collection[str] = ()) -> str | None:
        """An endpoint for one attempt, or None when every endpoint is excluded."""
        others = [e for e in self.endpoints if e not in exclude]
        if not others:
            return None
        candidates = [e for e in others if self.available(e)] or others  # panic: all
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if self.active[a] <= self.active[b] else b

    def started(self, endpoint: str) -> None:
        self.active[endpoint] += 1
        self.sent[endpoint] += 1

    def finished(self, endpoint: str) -> None:
        self.active[endpoint] -= 1


class RetryBudget:
    def __init__(self, budget_percent: float, min_retry_concurrency: int) -> None:
        self._percent = budget_percent
        self._minimum = min_retry_concurrency
        self.requests = 0  # in flight
        self.retries = 0  # retries in flight

    def allowed(self) -> int:
        return max(self._minimum, math.floor(self.requests * self._percent / 100))

    def try_acquire(self) -> bool:
        if self.retries >= self.allowed():
            return False
        self.retries += 1
        return True

    def release(self) -> None:
        self.retries -= 1
