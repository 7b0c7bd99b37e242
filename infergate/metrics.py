"""Prometheus metrics, one registry per gateway (so tests can run several in a process).
Names are prefixed infergate_; labels stay bounded (model, version, outcome)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

# A finished request as the infer route counts it: model, tenant ("-": none
# authenticated), HTTP status, latency in seconds, and when it ended (clock seconds).
Finished = tuple[str, str, int, float, float]


class _Tally:
    """One labelled series of a LoopCounter or LoopHistogram."""

    __slots__ = ("buckets", "count", "total", "_bounds")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.buckets = [0] * len(bounds)
        self.count = 0
        self.total = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.total += amount

    def observe(self, value: float) -> None:
        self.buckets[bisect_left(self._bounds, value)] += 1  # le: the first bound >= value
        self.count += 1
        self.total += value


class _LoopMetric:
    """A labelled counter or histogram for the request path, exposed through the registry
    as prometheus_client's own are (same names and samples, without `_created`). Theirs
    take a lock and check the series on every call (about 1.2 us an observe); these are
    touched only from the event loop's thread, so a bisect and two additions do."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float] = (),
    ) -> None:
        self._name, self._doc, self._labelnames = name, documentation, tuple(labelnames)
        self._bounds = (*(float(b) for b in buckets), float("inf")) if buckets else ()
        self._series: dict[tuple[str, ...], _Tally] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Tally:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}, got {values}")
            series = self._series[values] = _Tally(self._bounds)
        return series

    def describe(self) -> Iterator[Metric]:
        if self._bounds:
            yield HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        else:
            yield CounterMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        if not self._bounds:
            counter = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
            for values, series in list(self._series.items()):
                counter.add_metric(list(values), series.total)
            yield counter
            return
        histogram = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        les = ["+Inf" if b == float("inf") else repr(b) for b in self._bounds]  # as Go prints
        for values, series in list(self._series.items()):
            cumulative, seen = [], 0
            for le, n in zip(les, series.buckets, strict=True):
                seen += n
                cumulative.append((le, float(seen)))
            histogram.add_metric(list(values), cumulative, series.total)
        yield histogram


class LoopCounter(_LoopMetric):
    pass


class LoopHistogram(_LoopMetric):
    pass


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
        self.shed = Counter(
            "infergate_requests_shed",
            "Requests refused or dropped by the scheduler, by class and why "
            "(queue_full, shed, deadline)",
            ["model", "class", "reason"],
            registry=self.registry,
        )
        self.batch_size = LoopHistogram(
            "infergate_batch_size",
            "Rows in each batch run on a worker",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.queue_seconds = LoopHistogram(
            "infergate_queue_seconds",
            "Time a request waited in its model's queue",
            ["model", "class"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
            registry=self.registry,
        )
        self.compute_seconds = LoopHistogram(
            "infergate_compute_seconds",
            "Time a batch took on its worker, transfer included",
            ["model"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            "infergate_breaker_state",
            "Circuit breaker per model version: 0 closed, 1 half-open, 2 open",
            ["model", "version"],
            registry=self.registry,
        )
        self.requests = LoopCounter(
            "infergate_requests",
            "Inference requests by model, tenant and HTTP status",
            ["model", "tenant", "status"],
            registry=self.registry,
        )
        self.request_seconds = LoopHistogram(
            "infergate_request_duration_seconds",
            "End-to-end inference request time in the gateway (read to answer), by model "
            "and tenant, failures included",
            ["model", "tenant"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "infergate_rate_limited",
            "Requests refused by a tenant's limits (rate, concurrency, allow-list)",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "infergate_queue_depth",
            "Requests waiting per model and priority class (at scrape time)",
            ["model", "class"],
            registry=self.registry,
        )
        self.device_utilization = Gauge(
            "infergate_device_utilization_percent",
            "Device utilisation (at scrape time)",
            ["device"],
            registry=self.registry,
        )
        self.device_memory = Gauge(
            "infergate_device_memory_used_bytes",
            "Device memory in use (at scrape time)",
            ["device"],
            registry=self.registry,
        )
        self.worker_memory = Gauge(
            "infergate_worker_memory_bytes",
            "Memory of each worker process (at scrape time)",
            ["model", "version", "instance"],
            registry=self.registry,
        )
        self.worker_kills = Counter(
            "infergate_worker_kills",
            "Workers killed by the gateway, by reason (memory)",
            ["model", "reason"],
            registry=self.registry,
        )
        self.worker_restarts = Counter(
            "infergate_worker_restarts",
            "Worker processes restarted after dying, hanging or being killed",
            ["model"],
            registry=self.registry,
        )
        self.retries = Counter(
            "infergate_retries",
            "Work run again after its worker died, timed out or was killed for its memory",
            ["model"],
            registry=self.registry,
        )
        # The hardening series (issue 13): the loop's responsiveness, workers that could
        # not start, and whether the repository is being watched.
        self.loop_lag = Gauge(
            "infergate_event_loop_lag_seconds",
            "How late the gateway's event loop ran a timer, last sample (every 0.25 s)",
            registry=self.registry,
        )
        self.loop_lag_seconds = Histogram(
            "infergate_event_loop_lag",
            "How late the gateway's event loop ran a timer, every 0.25 s",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=self.registry,
        )
        self.worker_start_failures = Counter(
            "infergate_worker_start_failures",
            "Worker processes that could not be started (out of fds, memory...); retried",
            ["model"],
            registry=self.registry,
        )
        self.watching = Gauge(
            "infergate_repository_watching",
            "1 while the models folder is watched for changes, 0 when watching failed",
            registry=self.registry,
        )
        self.watch_failures = Counter(
            "infergate_repository_watch_failures",
            "Attempts to watch the models folder that failed (each is retried)",
            registry=self.registry,
        )
        # [server] max_bodies_mb (server/body_budget.py), at scrape time.
        self.bodies_held = Gauge(
            "infergate_request_bodies_bytes",
            "Bytes of request bodies over 64 KB held now, against [server] max_bodies_mb",
            registry=self.registry,
        )
        self.bodies_waiting = Gauge(
            "infergate_request_bodies_waiting",
            "Requests whose body waits, unread, for room in [server] max_bodies_mb",
            registry=self.registry,
        )
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self._done: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def child(self, metric: Counter | Histogram | _LoopMetric, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: labels() validates and locks on every call, and
        the request path asks for the same few children over and over (their label values
        are bounded)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def requests_done(self, done: list[Finished]) -> None:
        """Count the requests an event loop step answered (a batch's, under load)."""
        key: tuple[str, str, int] | None = None
        counter: Any  # the two children of the run's key (set on its first request)
        histogram: Any
        for model, tenant, status, seconds, _ in done:
            if key is None or key[0] != model or key[1] != tenant or key[2] != status:
                key = (model, tenant, status)
                pair = self._done.get(key)  # one lookup for both children
                if pair is None:
                    pair = self._done[key] = (
                        self.child(self.requests, model, tenant, str(status)),
                        self.child(self.request_seconds, model, tenant),
                    )
                counter, histogram = pair
            counter.inc()
            histogram.observe(seconds)
