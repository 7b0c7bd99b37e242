"""Where a server spent a load run's time: the model's queue and compute totals from its
Triton statistics endpoint (`GET /v2/models/{m}/stats`, which infergate and Triton both
answer), read before and after the measured windows, as averages per request."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import orjson

from infergate.rawhttp import RawConnection

if TYPE_CHECKING:
    from infergate.loadgen import LoadResult, Target

_KEY_HEADERS = ("authorization", "x-api-key")
Totals = tuple[float, float, float, float]  # queue s, queued requests, compute s, computed


@dataclass(frozen=True)
class ServerSplit:
    """Where the server spent the time, read from its statistics endpoint over the measured
    windows: the average wait in the model's queue and the average compute (the run of the
    batch it was in), per request."""

    queue_ms: float | None
    compute_ms: float | None


def with_split(
    result: LoadResult,
    before: Totals | None,
    after: Totals | None,
) -> LoadResult:
    if before is None or after is None:
        return result
    queue_s, queue_n, compute_s, compute_n = (a - b for a, b in zip(after, before, strict=True))
    split = ServerSplit(
        queue_s / queue_n * 1000 if queue_n > 0 else None,
        compute_s / compute_n * 1000 if compute_n > 0 else None,
    )
    return replace(result, server=split)


def parse_split(stats: bytes) -> Totals:
    """(queue seconds, queued requests, compute seconds, computed requests), summed over the
    model's versions, from a Triton statistics document (`GET /v2/models/{m}/stats`), which
    infergate and Triton both answer (perf_analyzer reads the same)."""
    doc = orjson.loads(stats)
    q_s = q_n = c_s = c_n = 0.0
    for version in doc.get("model_stats", []):
        inference = version.get("inference_stats", {})
        queue, compute = inference.get("queue", {}), inference.get("compute_infer", {})
        q_s += float(queue.get("ns", 0)) / 1e9
        q_n += float(queue.get("count", 0))
        c_s += float(compute.get("ns", 0)) / 1e9
        c_n += float(compute.get("count", 0))
    return q_s, q_n, c_s, c_n


def server_split_reader(
    target: Target,
) -> Callable[[], Coroutine[Any, Any, Totals | None]]:
    """Reads the model's queue and compute totals from its statistics endpoint; None when
    the server does not answer it."""
    path = f"/v2/models/{quote(target.model, safe='')}/stats"
    # The load's own key: with [server] private_models a model's statistics need one.
    auth = {k: v for k, v in target.headers.items() if k.lower() in _KEY_HEADERS}

    async def read() -> Totals | None:
        try:
            conn = await RawConnection.open(target.url)
        except OSError:
            return None
        try:
            response = await conn.send(conn.request_bytes("GET", path, b"", auth))
        except OSError:
            return None
        finally:
            await conn.close()
        if response.status != 200:
            return None
        try:
            return parse_split(response.body)
        except (ValueError, TypeError, AttributeError):
            return None

    return read
