"""Prometheus metrics, one registry per gateway (so tests can run several in a process).
Names are prefixed infergate_; labels stay bounded (model, version, outcome)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reloads = Counter(
            "infergate_model_reloads",
            "Model loads and reloads by outcome (ready, failed)",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.reload_seconds = Histogram(
            "infergate_model_reload_seconds",
            "Time from a file being stable to its new version serving",
            ["model"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.worker_restarts = Counter(
            "infergate_worker_restarts",
            "Worker processes restarted after dying, hanging or being killed",
            ["model"],
            registry=self.registry,
        )
