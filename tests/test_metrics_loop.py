"""The request path's own counters and histograms (infergate/metrics.py) read on /metrics
exactly as prometheus_client's would: same names, labels, buckets and sums."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from infergate.metrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.005, 0.1, 1, 30)
VALUES = (0.0, 0.001, 0.0011, 0.005, 0.2, 1.0, 29.9, 31.0, 1e9)


def _samples(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_loop_metrics_expose_what_prometheus_client_does() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    their_h = Histogram("t_seconds", "doc", ["model", "tenant"], buckets=BUCKETS, registry=theirs)
    our_h = LoopHistogram("t_seconds", "doc", ["model", "tenant"], buckets=BUCKETS, registry=ours)
    their_c = Counter("t_requests", "doc", ["model", "status"], registry=theirs)
    our_c = LoopCounter("t_requests", "doc", ["model", "status"], registry=ours)
    for i, value in enumerate(VALUES):
        tenant = "a" if i % 2 else "b"
        their_h.labels("m", tenant).observe(value)
        our_h.labels("m", tenant).observe(value)
        their_c.labels("m", str(200 + i % 3)).inc()
        our_c.labels("m", str(200 + i % 3)).inc()
    assert _samples(ours) == _samples(theirs)
    assert ours.get_sample_value("t_requests_total", {"model": "m", "status": "200"}) == 3
