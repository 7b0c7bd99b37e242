"""What a load run counts, and how: its results (throughput and latency of the
successful requests, failures by kind and status with the first error text), the window
that answers are counted into, perf_analyzer's stability check over the last three
windows, and the merge of windows into one result (infergate.loadgen drives the load)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from infergate.server_split import ServerSplit

Mode = Literal["concurrency", "rate"]
# A failure's kind: the server answered with an error status, never answered (connection
# lost or refused), or the request was never sent (open loop with every connection busy).
FailureKind = Literal["http", "no_answer", "not_sent"]
PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    status: int | None  # the HTTP status for kind "http", else None
    count: int
    error: str  # the server's error text (the first seen), or what went wrong


@dataclass(frozen=True)
class Latency:
    """Milliseconds, over successful requests only."""

    p50: float
    p90: float
    p95: float
    p99: float
    avg: float
    max: float


@dataclass(frozen=True)
class LoadResult:
    mode: Mode
    level: float  # the concurrency, or the requests/s asked for
    requests: int  # due in the measured windows: ok + failed
    ok: int
    failed: int
    seconds: float
    throughput_rps: float  # successful requests per second
    latency_ms: Latency | None  # None when nothing succeeded
    failures: tuple[Failure, ...] = ()
    server: ServerSplit | None = None
    windows: int = 1  # the windows this result merges (the last 3 when checking stability)
    stable: bool | None = None  # None: a fixed number of windows, no stability check
    windows_measured: int = 1  # all the windows run at this level

    # The benchmarks' view: throughput, two percentiles (0 when nothing succeeded), and
    # failures by status (0: no answer or not sent).
    @property
    def rps(self) -> float:
        return self.throughput_rps

    @property
    def p50_ms(self) -> float:
        return self.latency_ms.p50 if self.latency_ms else 0.0

    @property
    def p99_ms(self) -> float:
        return self.latency_ms.p99 if self.latency_ms else 0.0

    @property
    def errors(self) -> dict[int, int]:
        out: Counter[int] = Counter()
        for f in self.failures:
            out[f.status or 0] += f.count
        return dict(out)


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest rank, in milliseconds."""
    rank = max(0, min(len(ordered) - 1, int(np.ceil(q / 100 * len(ordered))) - 1))
    return ordered[rank] * 1000


def latency_of(latencies: list[float]) -> Latency | None:
    if not latencies:
        return None
    ordered = sorted(latencies)
    p50, p90, p95, p99 = (_percentile(ordered, q) for q in PERCENTILES)
    return Latency(p50, p90, p95, p99, sum(ordered) / len(ordered) * 1000, ordered[-1] * 1000)


@dataclass
class Window:
    """The answers counted in one measurement window."""

    started: float
    latencies: list[float] = field(default_factory=list)
    failures: Counter[tuple[FailureKind, int | None]] = field(default_factory=Counter)
    errors: dict[tuple[FailureKind, int | None], str] = field(default_factory=dict)
    seconds: float = 0.0


class Collector:
    """Counts answers into the current window; `take` closes it and opens the next."""

    def __init__(self) -> None:
        self.window = Window(time.perf_counter())
        self.total_ok = 0
        self.total_failed = 0
        self.unanswered = 0

    def ok(self, latency: float) -> None:
        self.window.latencies.append(latency)
        self.total_ok += 1

    def fail(self, kind: FailureKind, status: int | None, error: str) -> None:
        key = (kind, status)
        self.window.failures[key] += 1
        self.window.errors.setdefault(key, error)
        self.total_failed += 1

    def take(self) -> Window:
        now = time.perf_counter()
        done, self.window = self.window, Window(now)
        done.seconds = now - done.started
        return done


def is_stable(windows: list[Window], pct: float) -> bool:
    """perf_analyzer's check: the last three windows' throughput and average latency each
    lie within `pct` percent of their mean."""
    if len(windows) < 3:
        return False
    last = windows[-3:]
    rates = [len(w.latencies) / w.seconds for w in last]
    means = [sum(w.latencies) / len(w.latencies) if w.latencies else 0.0 for w in last]
    for values in (rates, means):
        mean = sum(values) / 3
        if mean > 0 and (max(values) - min(values)) / mean > pct / 100:
            return False
    return True


def merge(mode: Mode, level: float, windows: list[Window], stable: bool | None) -> LoadResult:
    """The windows' answers as one result at this level."""
    latencies = [x for w in windows for x in w.latencies]
    failures: Counter[tuple[FailureKind, int | None]] = Counter()
    errors: dict[tuple[FailureKind, int | None], str] = {}
    for w in windows:
        failures.update(w.failures)
        for key, text in w.errors.items():
            errors.setdefault(key, text)
    seconds = sum(w.seconds for w in windows)
    failed = sum(failures.values())
    return LoadResult(
        mode=mode,
        level=level,
        requests=len(latencies) + failed,
        ok=len(latencies),
        failed=failed,
        seconds=seconds,
        throughput_rps=len(latencies) / seconds if seconds > 0 else 0.0,
        latency_ms=latency_of(latencies),
        failures=tuple(
            Failure(kind, status, count, errors[(kind, status)])
            for (kind, status), count in sorted(
                failures.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)
            )
        ),
        windows=len(windows),
        stable=stable,
    )
