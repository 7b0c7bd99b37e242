"""The remote runtime's Prometheus series, registered once per gateway registry (the
shared Metrics object stays untouched; labels are bounded by the endpoints in model.toml).
"""

from __future__ import annotations

import weakref

from prometheus_client import Counter, Gauge

from infergate.metrics import Metrics


class RemoteMetrics:
    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.attempts = Counter(
            "infergate_remote_attempts",
            "Requests sent to a remote model's endpoints, by outcome (2xx, 4xx, 5xx, "
            "connect_failed, timeout, broken)",
            ["model", "endpoint", "outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "infergate_remote_retries",
            "Retries on another endpoint, by why (connect_failed, 503), and those the retry "
            "budget or the retry limit refused (refused)",
            ["model", "why"],
            registry=registry,
        )
        self.ejections = Counter(
            "infergate_remote_ejections",
            "Endpoints ejected by outlier detection (consecutive 5xx)",
            ["model", "endpoint"],
            registry=registry,
        )
        self.healthy = Gauge(
            "infergate_remote_endpoint_healthy",
            "1 while an endpoint passes its active health checks",
            ["model", "endpoint"],
            registry=registry,
        )
        self.ejected = Gauge(
            "infergate_remote_endpoint_ejected",
            "1 while outlier detection keeps an endpoint out",
            ["model", "endpoint"],
            registry=registry,
        )


_by_metrics: weakref.WeakKeyDictionary[Metrics, RemoteMetrics] = weakref.WeakKeyDictionary()


def remote_metrics(metrics: Metrics) -> RemoteMetrics:
    found = _by_metrics.get(metrics)
    if found is None:
        found = _by_metrics[metrics] = RemoteMetrics(metrics)
    return found
