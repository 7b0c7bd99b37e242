"""Live request statistics for the dashboard: per model and overall, in one-second buckets
over the last minutes (rates, p50/p99, errors). Prometheus keeps the long history; this is
the small rolling view `/admin/stats` serves."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from infergate.clock import Clock
from infergate.metrics import Finished

_MAX_SAMPLES = 512  # latencies kept per bucket; enough for a p99 of a second's traffic
_MAX_CHAINS = 4096  # (model, tenant) pairs remembered: each request finds its series once


@dataclass
class _Second:
    at: int
    count: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)


class _Series:
    def __init__(self, keep_s: int) -> None:
        self.seconds: deque[_Second] = deque(maxlen=keep_s)
        self._last = _Second(-(1 << 62))  # the newest second (a placeholder until the first)

    def add(self, at: int, ok: bool, latency_s: float) -> None:
        self.add_all(at, 1, 0 if ok else 1, [latency_s])

    def add_all(self, at: int, count: int, errors: int, latencies: list[float]) -> None:
        """`count` requests that ended in second `at`, `errors` of them failed."""
        bucket = self._last
        if bucket.at != at:
            bucket = self._last = _Second(at)
            self.seconds.append(bucket)
        bucket.count += count
        bucket.errors += errors
        room = _MAX_SAMPLES - len(bucket.latencies)
        if room > 0:
            bucket.latencies += latencies if len(latencies) <= room else latencies[:room]

    def summary(self, now: int, span_s: int) -> dict[str, float]:
        recent = [s for s in self.seconds if now - span_s <= s.at < now]
        count = sum(s.count for s in recent)
        latencies = sorted(x for s in recent for x in s.latencies)
        return {
            "rps": count / span_s,
            "errors": sum(s.errors for s in recent),
            "p50_ms": _pct(latencies, 0.5),
            "p99_ms": _pct(latencies, 0.99),
        }

    def history(self, now: int, span_s: int) -> list[dict[str, float]]:
        by_second = {s.at: s for s in self.seconds}
        out = []
        for at in range(now - span_s, now):
            s = by_second.get(at)
            out.append(
                {
                    "t": at,
                    "rps": s.count if s else 0,
                    "p99_ms": _pct(sorted(s.latencies), 0.99) if s else 0.0,
                }
            )
        return out


def _pct(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)


class RequestStats:
    def __init__(self, clock: Clock, keep_s: int = 300) -> None:
        self._clock = clock
        self._keep_s = keep_s
        self._total = _Series(keep_s)
        self._models: dict[str, _Series] = {}
        self._tenants: dict[str, _Series] = {}
        # (model, tenant) -> every series a request of theirs counts in, found once
        self._chains: dict[tuple[str, str | None], tuple[_Series, ...]] = {}

    def record(
        self,
        model: str,
        ok: bool,
        latency_s: float,
        tenant: str | None = None,
        now: float | None = None,
    ) -> None:
        """One finished request; `now` saves a clock read when the caller has one."""
        at = int(self._clock.now() if now is None else now)
        chain = self._chains.get((model, tenant))
        if chain is None:
            chain = self._chain(model, tenant)
        for series in chain:
            series.add(at, ok, latency_s)

    def record_all(self, done: list[Finished]) -> None:
        """`record` for the requests an event loop step answered (a batch's, under load):
        each run of one model, tenant and second is added to its series at once, instead
        of each request to each of its three."""
        key: tuple[str, str, int] | None = None
        count = errors = 0
        latencies: list[float] = []
        for model, tenant, status, seconds, now in done:
            at = int(now)
            if key is None or key[0] != model or key[1] != tenant or key[2] != at:
                if key is not None:
                    self._add_run(key, count, errors, latencies)
                key, count, errors, latencies = (model, tenant, at), 0, 0, []
            count += 1
            if status >= 500:
                errors += 1
            latencies.append(seconds)
        if key is not None:
            self._add_run(key, count, errors, latencies)

    def _add_run(
        self, key: tuple[str, str, int], count: int, errors: int, latencies: list[float]
    ) -> None:
        model, tenant, at = key
        named = None if tenant == "-" else tenant
        chain = self._chains.get((model, named))
        if chain is None:
            chain = self._chain(model, named)
        for series in chain:
            series.add_all(at, count, errors, latencies)

    def _chain(self, model: str, tenant: str | None) -> tuple[_Series, ...]:
        chain: tuple[_Series, ...] = (self._total, self._series(self._models, model))
        if tenant is not None:
            chain += (self._series(self._tenants, tenant),)
        if len(self._chains) >= _MAX_CHAINS:  # labels are bounded, but not by this table
            self._chains.clear()
        self._chains[(model, tenant)] = chain
        return chain

    def _series(self, by_name: dict[str, _Series], name: str) -> _Series:
        series = by_name.get(name)
        if series is None:  # not setdefault: that would build a new series on every call
            series = by_name[name] = _Series(self._keep_s)
        return series

    def tenant_rps(self, name: str, span_s: int = 10) -> float:
        series = self._tenants.get(name)
        return series.summary(int(self._clock.now()), span_s)["rps"] if series else 0.0

    def model(self, name: str, span_s: int = 10) -> dict[str, float]:
        series = self._models.get(name)
        now = int(self._clock.now())
        if series is None:
            return {"rps": 0.0, "errors": 0, "p50_ms": 0.0, "p99_ms": 0.0}
        return series.summary(now, span_s)

    def history(self, span_s: int = 120) -> list[dict[str, float]]:
        return self._total.history(int(self._clock.now()), span_s)
