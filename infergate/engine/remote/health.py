"""Active health checks: each endpoint's GET /v2/health/ready, every `health_interval_s`.

An endpoint turns unhealthy after `unhealthy_threshold` failed checks in a row and healthy
again after `healthy_threshold` passing ones (Envoy's meanings). Endpoints start healthy,
as the load-time check has just reached one of them; a check's verdict and the outlier
detector's are independent: the balancer avoids an endpoint that either rules out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class HealthState:
    healthy: bool = True
    passes: int = 0  # in a row
    fails: int = 0  # in a row
    last_error: str | None = None


class HealthChecks:
    def __init__(
        self,
        endpoints: list[str],
        unhealthy_threshold: int,
        healthy_threshold: int,
        on_change: Callable[[str, bool, str], None] | None = None,
    ) -> None:
        self.states = {e: HealthState() for e in endpoints}
        self._unhealthy = unhealthy_threshold
        self._healthy = healthy_threshold
        self._on_change = on_change or (lambda endpoint, healthy, why: None)

    def record(self, endpoint: str, ok: bool, why: str = "") -> None:
        state = self.states[endpoint]
        if ok:
            state.passes, state.fails, state.last_error = state.passes + 1, 0, None
            if not state.healthy and state.passes >= self._healthy:
                state.healthy = True
                self._on_change(endpoint, True, "/v2/health/ready answers 200 again")
        else:
            state.passes, state.fails, state.last_error = 0, state.fails + 1, why
            if state.healthy and state.fails >= self._unhealthy:
                state.healthy = False
                self._on_change(endpoint, False, f"/v2/health/ready failed: {why}")

    def is_healthy(self, endpoint: str) -> bool:
        return self.states[endpoint].healthy
