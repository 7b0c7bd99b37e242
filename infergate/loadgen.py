"""Load generation for `infergate bench` and the benchmarks, in the manner of Triton's
perf_analyzer: closed loop at a fixed concurrency, or open loop at a fixed request rate.

Requests are prepared once (binary or JSON tensors) and sent over keep-alive connections
with the minimal client in rawhttp, so that on a small machine the generator costs little
next to the server it measures.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from infergate.client import encode_infer_request
from infergate.rawhttp import RawConnection
from infergate.tensors import Array, numpy_dtype

Progress = Callable[[float], None]  # called with the seconds done so far
T = TypeVar("T")


@dataclass(frozen=True)
class LoadResult:
    mode: str  # "concurrency" or "rate"
    level: float  # the concurrency, or the requests/s asked for
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: dict[int, int] = field(default_factory=dict)  # status -> count; 0: no answer

    @property
    def ok(self) -> int:
        return self.requests - sum(self.errors.values())


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a load on uvloop when it is installed (it comes with uvicorn[standard]): its
    lower per-request cost leaves more of a small machine to the server under test."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def sample_inputs(metadata: dict[str, Any], batch: int, seed: int = 0) -> dict[str, Array]:
    """Inputs that fit a model's metadata: the first free dimension is `batch`, other free
    dimensions 1; values random in the datatype's range."""
    rng = np.random.default_rng(seed)
    out: dict[str, Array] = {}
    for spec in metadata.get("inputs", []):
        dims = spec["shape"]
        shape = tuple((batch if i == 0 else 1) if d < 0 else d for i, d in enumerate(dims))
        datatype = spec["datatype"]
        if datatype == "BYTES":
            array = np.empty(shape, dtype=object)
            array.fill(b"infergate")
        elif datatype == "BOOL":
            array = rng.integers(0, 2, shape).astype(bool)
        else:
            dtype = numpy_dtype(datatype)
            if dtype.kind == "f":
                array = rng.standard_normal(shape).astype(dtype)
            else:
                array = rng.integers(0, 10, shape).astype(dtype)
        out[spec["name"]] = array
    return out


def prepare(
    inputs: dict[str, Array], binary: bool, parameters: dict[str, Any] | None = None
) -> tuple[bytes, dict[str, str]]:
    return encode_infer_request(inputs, binary=binary, parameters=parameters)


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _result(
    mode: str, level: float, latencies: list[float], errors: Counter[int], seconds: float
) -> LoadResult:
    ordered = sorted(latencies)
    return LoadResult(
        mode,
        level,
        len(ordered),
        seconds,
        len(ordered) / seconds,
        _percentile(ordered, 0.5),
        _percentile(ordered, 0.9),
        _percentile(ordered, 0.99),
        dict(errors),
    )


class _Sender:
    def __init__(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        self.url, self.path, self.body, self.headers = url, path, body, headers
        self.latencies: list[float] = []
        self.errors: Counter[int] = Counter()

    async def connect(self) -> tuple[RawConnection, bytes]:
        conn = await RawConnection.open(self.url)
        return conn, conn.request_bytes("POST", self.path, self.body, self.headers)

    async def once(self, conn: RawConnection, prepared: bytes) -> bool:
        t0 = time.perf_counter()
        try:
            response = await conn.send(prepared)
        except OSError:
            self.latencies.append(time.perf_counter() - t0)
            self.errors[0] += 1
            return False
        self.latencies.append(time.perf_counter() - t0)
        if response.status != 200:
            self.errors[response.status] += 1
        return True


async def _ticker(started: float, duration_s: float, progress: Progress | None) -> None:
    while progress is not None:
        progress(min(time.perf_counter() - started, duration_s))
        await asyncio.sleep(0.1)


async def run_concurrency(
    url: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    concurrency: int,
    duration_s: float,
    progress: Progress | None = None,
) -> LoadResult:
    """Closed loop: `concurrency` clients, each sending its next request on an answer."""
    sender = _Sender(url, path, body, headers)
    conns = [await sender.connect() for _ in range(concurrency)]
    started = time.perf_counter()
    stop = started + duration_s

    async def client(conn: RawConnection, prepared: bytes) -> None:
        while time.perf_counter() < stop:
            if not await sender.once(conn, prepared):
                conn, prepared = await sender.connect()

    ticker = asyncio.create_task(_ticker(started, duration_s, progress))
    await asyncio.gather(*(client(c, p) for c, p in conns))
    seconds = time.perf_counter() - started
    ticker.cancel()
    for conn, _ in conns:
        await conn.close()
    return _result("concurrency", concurrency, sender.latencies, sender.errors, seconds)


async def run_rate(
    url: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    rate: float,
    duration_s: float,
    progress: Progress | None = None,
    max_connections: int = 512,
) -> LoadResult:
    """Open loop: send at `rate` requests/s whatever the answers take (up to
    `max_connections` outstanding; past that, late sends count as errors with status 0)."""
    sender = _Sender(url, path, body, headers)
    idle: list[tuple[RawConnection, bytes]] = []
    outstanding = 0
    started = time.perf_counter()

    async def one() -> None:
        nonlocal outstanding
        conn, prepared = idle.pop() if idle else await sender.connect()
        if await sender.once(conn, prepared):
            idle.append((conn, prepared))
        outstanding -= 1

    tasks = []
    ticker = asyncio.create_task(_ticker(started, duration_s, progress))
    count = int(rate * duration_s)
    for i in range(count):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if outstanding >= max_connections:
            sender.errors[0] += 1
            sender.latencies.append(0.0)
            continue
        outstanding += 1
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - started
    ticker.cancel()
    for conn, _ in idle:
        await conn.close()
    return _result("rate", rate, sender.latencies, sender.errors, seconds)
