"""The shared limits' metrics, in the gateway's registry (infergate/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ClusterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.redis_errors = Counter(
            "infergate_cluster_redis_errors",
            "Calls to Redis that failed or timed out, by operation (admit, release, renew, probe)",
            ["op"],
            registry=registry,
        )
        self.without_redis = Counter(
            "infergate_cluster_decisions_without_redis",
            "Admissions decided without Redis (it failed, timed out, or its breaker is "
            "open), by fail_mode and outcome (admitted, refused)",
            ["fail_mode", "outcome"],
            registry=registry,
        )
        self.asked_again = Counter(
            "infergate_cluster_admissions_asked_again",
            "Admissions that found no free slot and asked Redis once more (a release "
            "written by another replica may not have been applied yet)",
            registry=registry,
        )
        self.breaker_state = Gauge(
            "infergate_cluster_redis_breaker_state",
            "The breaker around Redis: 0 closed, 1 half-open, 2 open",
            registry=registry,
        )
        self.replicas = Gauge(
            "infergate_cluster_replicas",
            "Replicas last seen alive in Redis (the local share of a limit is 1/this)",
            registry=registry,
        )
