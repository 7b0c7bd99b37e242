"""Per-version statistics in Triton's schema (`GET /v2/models/{m}/stats`): counts and
summed durations of requests and of the batches they ran in. The scheduler reports each
finished batch; the served version reports each request's outcome.

Triton splits a batch's compute into input copy, inference and output copy. Here the copy
into and out of the worker's shared memory is part of one timed round trip, so all of it is
counted as compute_infer, and compute_input/compute_output carry the counts with 0 ns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class _BatchSize:
    compute_infer: Duration = field(default_factory=Duration)


def _counted(count: int) -> dict[str, int]:
    return {"count": count, "ns": 0}


@dataclass(slots=True)
class VersionStats:
    """What one served version has done since it loaded."""

    inference_count: int = 0  # rows (Triton counts each batch element)
    execution_count: int = 0  # batches run
    last_inference_ms: int = 0  # wall-clock ms since the epoch, as Triton reports it
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    batches: dict[int, _BatchSize] = field(default_factory=dict)

    def batch_done(self, rows: int, compute_s: float) -> None:
        """A batch of `rows` rows ran (called by the scheduler as it finishes)."""
        self.inference_count += rows
        self.execution_count += 1
        # A timestamp for people, not an input to any logic: wall time, as Triton's.
        self.last_inference_ms = time.time_ns() // 1_000_000
        by_size = self.batches.get(rows)
        if by_size is None:
            by_size = self.batches[rows] = _BatchSize()
        by_size.compute_infer.add(compute_s)

    def request_done(self, total_s: float, queue_s: float, compute_s: float) -> None:
        self.requests_done(1, total_s, queue_s, compute_s)

    def requests_done(self, count: int, total_s: float, queue_s: float, compute_s: float) -> None:
        """`count` requests succeeded (a batch's, under load: counted once for all), with
        the sums of their durations. Inline, not three add() calls."""
        success, queue, compute = self.success, self.queue, self.compute_infer
        success.count += count
        success.ns += int(total_s * 1e9)
        queue.count += count
        queue.ns += int(queue_s * 1e9)
        compute.count += count
        compute.ns += int(compute_s * 1e9)

    def request_failed(self, total_s: float) -> None:
        self.fail.add(total_s)

    def to_json(self, name: str, version: int) -> dict[str, Any]:
        done = self.compute_infer.count
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": _counted(done),
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": _counted(done),
                "cache_hit": _counted(0),
                "cache_miss": _counted(0),
            },
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": _counted(s.compute_infer.count),
                    "compute_infer": s.compute_infer.to_json(),
                    "compute_output": _counted(s.compute_infer.count),
                }
                for size, s in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }
