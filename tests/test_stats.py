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


def test_a_steps_answers_counted_at_once_show_as_counted_one_by_one() -> None:
    """The infer route counts the answers of one event-loop step together (`record_all`);
    the dashboard must show what counting each request alone shows: per model, per tenant
    and overall, across tenants, models, seconds and failures."""
    clock = FakeClock(100.0)
    done = [
        ("m", "a", 200, 0.001, 100.2),
        ("m", "a", 503, 0.002, 100.4),
        ("m", "b", 200, 0.003, 100.5),
        ("n", "-", 200, 0.004, 100.6),
        ("m", "a", 200, 0.005, 101.1),
        ("m", "a", 500, 0.006, 101.2),
    ]
    together, alone = RequestStats(clock), RequestStats(clock)
    together.record_all(done)
    for model, tenant, status, seconds, now in done:
        alone.record(model, status < 500, seconds, None if tenant == "-" else tenant, now)
    clock.advance(2.5)  # seconds 100 and 101 are over
    assert together.model("m", span_s=2) == alone.model("m", span_s=2)
    assert together.model("n", span_s=2) == alone.model("n", span_s=2)
    for tenant in ("a", "b", "-"):
        assert together.tenant_rps(tenant, span_s=2) == alone.tenant_rps(tenant, span_s=2)
    assert together.history(span_s=3) == alone.history(span_s=3)
    assert together.model("m", span_s=2)["errors"] == 2
    assert together.tenant_rps("a", span_s=2) == 2.0
