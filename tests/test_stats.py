"""The dashboard's rolling statistics, on an injected clock."""

from __future__ import annotations

from infergate.clock import FakeClock
from infergate.engine.stats import RequestStats


def test_rates_percentiles_errors_and_history() -> None:
    clock = FakeClock(100.0)
    stats = RequestStats(clock)
    for _ in range(10):
        for i in range(20):
            stats.record("m", ok=i != 0, latency_s=0.001 * (i + 1))
        clock.advance(1.0)
    summary = stats.model("m", span_s=10)
    assert summary["rps"] == 20
    assert summary["errors"] == 10
    assert summary["p50_ms"] == 11.0
    assert summary["p99_ms"] == 20.0
    assert stats.model("other")["rps"] == 0
    history = stats.history(span_s=12)
    assert [h["rps"] for h in history] == [0, 0] + [20] * 10
    clock.advance(30)
    assert stats.model("m", span_s=10)["rps"] == 0  # old seconds fall out of the window
