"""Load generation for `infergate bench` and the benchmarks, in the manner of Triton's
perf_analyzer: closed loop at a fixed concurrency, or open loop at a request rate (constant
or Poisson arrivals), measured in windows that repeat until they agree (or a fixed count).

Only successful requests count in throughput and latency; every failure is counted by its
status with the server's error text. Open-loop latency runs from when a request was due,
not from when it was sent, so a generator or server that falls behind shows up in the
latency instead of hiding in it; a request that could not be sent (every connection busy)
is a failure, not a zero latency.

Requests are prepared once (binary or JSON tensors) and sent over keep-alive connections
with the minimal client in rawhttp, so that on a small machine the generator costs little
next to the server it measures.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import numpy as np

from infergate.client import encode_infer_request, error_text
from infergate.rawhttp import RawConnection, RawResponse
from infergate.server_split import ServerSplit, Totals, with_split
from infergate.tensors import Array, numpy_dtype

T = TypeVar("T")
Mode = Literal["concurrency", "rate"]
Distribution = Literal["constant", "poisson"]
# A failure's kind: the server answered with an error status, never answered (connection
# lost or refused), or the request was never sent (open loop with every connection busy).
FailureKind = Literal["http", "no_answer", "not_sent"]
PERCENTILES = (50, 90, 95, 99)
DRAIN_S = 5.0  # after the last window, how long in-flight requests may take to finish


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


@dataclass(frozen=True)
class Target:
    url: str
    path: str
    body: bytes
    headers: dict[str, str]
    model: str = ""  # for reading the server's split from its statistics ("" skips it)


@dataclass(frozen=True)
class Plan:
    window_s: float = 2.0
    windows: int | None = None  # a fixed count; None: repeat until stable
    stability_pct: float = 10.0
    max_windows: int = 10
    max_connections: int = 512  # open loop: past this many outstanding, sends fail
    distribution: Distribution = "constant"
    seed: int = 0


@dataclass(frozen=True)
class Progress:
    """What a live progress line shows."""

    mode: Mode
    level: float
    elapsed_s: float
    ok: int
    failed: int

    def line(self) -> str:
        rate = self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (
            f"{self.mode} {self.level:g}: {self.elapsed_s:.1f} s, {rate:.0f} req/s ok, "
            f"{self.failed} errors"
        )


OnProgress = Callable[[Progress], None]


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a load on uvloop when it is installed (it comes with uvicorn[standard]): its
    lower per-request cost leaves more of a small machine to the server under test."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def sample_inputs(
    metadata: dict[str, Any],
    batch: int,
    seed: int = 0,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, Array]:
    """Inputs that fit a model's metadata: a leading free dimension is `batch`; the rest of
    the shape comes from `shapes` (perf_analyzer's --shape, without the batch dimension)
    or, for free dimensions, 1; values random in the datatype's range."""
    rng = np.random.default_rng(seed)
    out: dict[str, Array] = {}
    for spec in metadata.get("inputs", []):
        shape = input_shape(spec["name"], spec["shape"], batch, (shapes or {}).get(spec["name"]))
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


def input_shape(
    name: str, dims: list[int], batch: int, given: tuple[int, ...] | None
) -> tuple[int, ...]:
    batched = bool(dims) and dims[0] < 0
    rest = dims[1:] if batched else dims
    if given is None:
        shape = tuple(1 if d < 0 else d for d in rest)
    else:
        fits = len(given) == len(rest) and all(
            d < 0 or d == g for d, g in zip(rest, given, strict=True)
        )
        if not fits or any(g < 1 for g in given):
            raise ValueError(
                f"--shape {name}:{','.join(map(str, given))} does not fit the model's "
                f"{dims}. Hint: give every dimension after the batch one "
                f"({len(rest)} of them), keeping the fixed ones as they are"
            )
        shape = given
    return ((batch,) if batched else ()) + shape


def prepare(
    inputs: dict[str, Array], binary: bool, parameters: dict[str, Any] | None = None
) -> tuple[bytes, dict[str, str]]:
    return encode_infer_request(inputs, binary=binary, parameters=parameters)


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


def _error_text(body: bytes) -> str:
    """The server's error text on one line (a table cell, a JSON string): infergate's
    `error`, an HTML page's title, or the start of other text."""
    return error_text(body)


def _unreadable(response: RawResponse) -> str | None:
    """Why an answer cannot be counted, or None. The client reads answers by their
    Content-Length: one without it (chunked, or ended by closing) would leave its body to
    be misread as the next answer's head."""
    if b"\r\ncontent-length:" not in response.head.lower():
        return (
            f"unreadable answer (HTTP {response.status} without a Content-Length: a chunked "
            "or close-delimited body, which bench does not read)"
        )
    return None


@dataclass
class _Window:
    started: float
    latencies: list[float] = field(default_factory=list)
    failures: Counter[tuple[FailureKind, int | None]] = field(default_factory=Counter)
    errors: dict[tuple[FailureKind, int | None], str] = field(default_factory=dict)
    seconds: float = 0.0


class _Collector:
    """Counts answers into the current window; `take` closes it and opens the next."""

    def __init__(self) -> None:
        self.window = _Window(time.perf_counter())
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

    def take(self) -> _Window:
        now = time.perf_counter()
        done, self.window = self.window, _Window(now)
        done.seconds = now - done.started
        return done


async def _send(collector: _Collector, conn: RawConnection, prepared: bytes, since: float) -> bool:
    """One request; False when the connection is gone."""
    try:
        response = await conn.send(prepared)
    except asyncio.CancelledError:
        collector.unanswered += 1  # the run ended (and its drain time) with this one out
        raise
    except OSError as exc:
        collector.fail("no_answer", None, f"no answer: {type(exc).__name__}: {exc}")
        return False
    except Exception as exc:  # an answer rawhttp could not parse (not HTTP, a bad length)
        collector.fail("no_answer", None, f"unreadable answer: {type(exc).__name__}: {exc}")
        return False
    unreadable = _unreadable(response)
    if unreadable is not None:
        collector.fail("no_answer", None, unreadable)
        return False
    if response.status == 200:
        collector.ok(time.perf_counter() - since)
    else:
        collector.fail("http", response.status, _error_text(response.body))
    return True


async def _connect(target: Target) -> tuple[RawConnection, bytes]:
    conn = await RawConnection.open(target.url)
    return conn, conn.request_bytes("POST", target.path, target.body, target.headers)


async def _closed_loop(
    target: Target, concurrency: int, collector: _Collector, stop: asyncio.Event
) -> None:
    async def client() -> None:
        link: tuple[RawConnection, bytes] | None = None
        try:
            while not stop.is_set():
                if link is None:
                    try:
                        link = await _connect(target)
                    except OSError as exc:
                        collector.fail("no_answer", None, f"cannot connect: {exc}")
                        await asyncio.sleep(0.1)  # back off: the server is not listening
                        continue
                conn, prepared = link
                if not await _send(collector, conn, prepared, time.perf_counter()):
                    await conn.close()
                    link = None
        finally:  # also when cancelled with a request unanswered
            if link is not None:
                await link[0].close()

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def _open_loop(
    target: Target, rate: float, plan: Plan, collector: _Collector, stop: asyncio.Event
) -> None:
    rng = np.random.default_rng(plan.seed)
    idle: list[tuple[RawConnection, bytes]] = []
    tasks: set[asyncio.Task[None]] = set()

    opened: list[RawConnection] = []  # every connection, closed at the end whatever happened

    async def one(due: float) -> None:
        if idle:
            link = idle.pop()
        else:
            try:
                link = await _connect(target)
            except OSError as exc:
                collector.fail("no_answer", None, f"cannot connect: {exc}")
                return
            opened.append(link[0])
        if await _send(collector, link[0], link[1], due):
            idle.append(link)

    due = time.perf_counter()
    while not stop.is_set():
        gap = rng.exponential(1 / rate) if plan.distribution == "poisson" else 1 / rate
        due += gap
        delay = due - time.perf_counter()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except asyncio.TimeoutError:
                pass
        if len(tasks) >= plan.max_connections:
            collector.fail(
                "not_sent",
                None,
                f"not sent: all {plan.max_connections} connections were waiting for answers. "
                "Hint: raise --max-connections or lower the rate",
            )
            continue
        task = asyncio.create_task(one(due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    try:  # let the requests still out finish (they are not counted), up to DRAIN_S
        if tasks:
            await asyncio.wait(set(tasks), timeout=DRAIN_S)
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in opened:
            await conn.close()


def _stable(windows: list[_Window], pct: float) -> bool:
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


def _merge(mode: Mode, level: float, windows: list[_Window], stable: bool | None) -> LoadResult:
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


async def run_level(
    target: Target,
    mode: Mode,
    level: float,
    plan: Plan,
    on_progress: OnProgress | None = None,
    server_split: Callable[[], Coroutine[Any, Any, Totals | None]] | None = None,
) -> LoadResult:
    """Drive one level of load and measure it in windows: a fixed number, or until the last
    three agree (at most `plan.max_windows`); the result merges the windows it reports."""
    collector = _Collector()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()
    loop.set_exception_handler(_quiet_connection_errors(handler))
    try:
        return await _run_level(
            target, mode, level, plan, collector, stop, on_progress, server_split
        )
    finally:
        loop.set_exception_handler(handler)


ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def _quiet_connection_errors(handler: ExceptionHandler | None) -> ExceptionHandler:
    """An answer that rawhttp's protocol cannot parse fails the request waiting for it (a
    failure counted as such) and closes its connection; the loop would also print it, a
    traceback on stderr for each. Everything else goes to `handler` (else the default)."""

    def quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("protocol") is not None and context.get("transport") is not None:
            return
        if handler is not None:
            handler(loop, context)
        else:
            loop.default_exception_handler(context)

    return quiet


async def _run_level(
    target: Target,
    mode: Mode,
    level: float,
    plan: Plan,
    collector: _Collector,
    stop: asyncio.Event,
    on_progress: OnProgress | None,
    server_split: Callable[[], Coroutine[Any, Any, Totals | None]] | None,
) -> LoadResult:
    if mode == "concurrency":
        load = asyncio.create_task(_closed_loop(target, int(level), collector, stop))
    else:
        load = asyncio.create_task(_open_loop(target, level, plan, collector, stop))
    started = time.perf_counter()
    windows: list[_Window] = []
    marks = [await server_split()] if server_split else []
    wanted = plan.windows or plan.max_windows
    stable: bool | None = None if plan.windows else False
    while len(windows) < wanted:
        end = collector.window.started + plan.window_s
        while (left := end - time.perf_counter()) > 0 and not load.done():
            await asyncio.sleep(min(0.25, left))  # the window's length is the measurement
            if on_progress is not None:
                elapsed = time.perf_counter() - started
                on_progress(
                    Progress(mode, level, elapsed, collector.total_ok, collector.total_failed)
                )
        windows.append(collector.take())
        if server_split:
            marks.append(await server_split())
        if plan.windows is None and _stable(windows, plan.stability_pct):
            stable = True
            break
        if load.done():
            break
    stop.set()
    # Requests still out are not counted; wait a little for them, not for a hung model.
    await asyncio.wait({load}, timeout=DRAIN_S + 1)
    if not load.done():
        load.cancel()
    await asyncio.gather(load, return_exceptions=True)
    counted = windows if plan.windows else windows[-3:]
    result = replace(_merge(mode, level, counted, stable), windows_measured=len(windows))
    if collector.unanswered:  # a hung model must not look like an idle one
        lost = Failure(
            "no_answer",
            None,
            collector.unanswered,
            f"no answer by the end of the run ({DRAIN_S:g} s after the last window)",
        )
        result = replace(
            result,
            requests=result.requests + lost.count,
            failed=result.failed + lost.count,
            failures=(*result.failures, lost),
        )
    if server_split and marks:
        first, last = marks[-len(counted) - 1], marks[-1]
        result = with_split(result, first, last)
    return result


async def run_concurrency(
    url: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    concurrency: int,
    duration_s: float,
) -> LoadResult:
    """Closed loop for one window of `duration_s`: `concurrency` clients, each sending its
    next request on an answer (the benchmarks' entry point)."""
    plan = Plan(window_s=duration_s, windows=1)
    return await run_level(Target(url, path, body, headers), "concurrency", concurrency, plan)


async def run_rate(
    url: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    rate: float,
    duration_s: float,
    max_connections: int = 512,
) -> LoadResult:
    """Open loop for one window of `duration_s` at `rate` requests/s, constant arrivals."""
    plan = Plan(window_s=duration_s, windows=1, max_connections=max_connections)
    return await run_level(Target(url, path, body, headers), "rate", rate, plan)
