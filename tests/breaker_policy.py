"""The breaker policy and helpers the breaker's tenant tests share."""

from __future__ import annotations

from infergate.engine.admission.breaker import Breaker, BreakerPolicy

POLICY = BreakerPolicy(
    window_seconds=1,
    failure_rate=0.3,
    latency_p99_ms=100,
    consecutive_windows=1,
    min_requests=4,
    backoff_initial_s=2,
    backoff_max_s=5,
    probes=1,
)


def state(breaker: Breaker) -> str:
    """The breaker's state now (a call: mypy would narrow a property read twice)."""
    return breaker.state
