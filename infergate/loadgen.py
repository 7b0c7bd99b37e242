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
next to the server it measures. Answers are read within limits (a head of 64 KiB, a body of
Plan.max_answer_mb of which only the start is kept): a server cannot grow the generator,
and an answer past them is a failure that says so. Nothing the server does holds a level
past its windows and DRAIN_S: requests still out are cancelled, the statistics read for
the server's split waits SPLIT_TIMEOUT_S at most.

This module drives the load and measures it; beside it, loadgen_inputs makes the requests
and loadgen_results counts the answers (their names importable from here as before).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import numpy as np

from infergate.client_codec import MAX_ANSWER_MB
from infergate.client_errors import error_text
from infergate.loadgen_inputs import input_shape, prepare, sample_inputs
from infergate.loadgen_results import (
    PERCENTILES,
    Collector,
    Failure,
    FailureKind,
    Latency,
    LoadResult,
    Mode,
    Window,
    is_stable,
    latency_of,
    merge,
)
from infergate.rawhttp import AnswerLimits, RawConnection, RawResponse, Refusal
from infergate.server_split import Totals, with_split

__all__ = [
    "DRAIN_S",
    "PERCENTILES",
    "SPLIT_TIMEOUT_S",
    "Distribution",
    "Failure",
    "FailureKind",
    "Latency",
    "LoadResult",
    "Mode",
    "OnProgress",
    "Plan",
    "Progress",
    "Target",
    "input_shape",
    "latency_of",
    "prepare",
    "run",
    "run_concurrency",
    "run_level",
    "run_rate",
    "sample_inputs",
]

T = TypeVar("T")
Distribution = Literal["constant", "poisson"]
SplitReader = Callable[[], Coroutine[Any, Any, "Totals | None"]]
DRAIN_S = 5.0  # after the last window, how long in-flight requests may take to finish
# How long a read of the model's statistics (the server's split) may take: a server that
# stops answering it must not hold the run (a read that runs out ends the level's split).
SPLIT_TIMEOUT_S = 5.0
# Of an answer's body, the start kept: an error's text is read from it, a success's body
# is not read at all (so a large answer costs no memory, however many are out).
KEPT_BODY_BYTES = 64 << 10


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
    max_answer_mb: int = MAX_ANSWER_MB  # an answer whose Content-Length says more fails


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


def _error_text(body: bytes) -> str:
    """The server's error text on one line (a table cell, a JSON string): infergate's
    `error`, an HTML page's title, or the start of other text."""
    return error_text(body)


def _unreadable(response: RawResponse) -> str | None:
    """Why an answer cannot be counted, or None. The client reads answers by their
    Content-Length: one without it (chunked, or ended by closing) would leave its body to
    be misread as the next answer's head."""
    if response.length is None:
        return (
            f"unreadable answer (HTTP {response.status} without a Content-Length: a chunked "
            "or close-delimited body, which bench does not read)"
        )
    return None


_REFUSED_HINTS = {
    "head": "Hint: is --url an infergate server?",
    "unasked": "Hint: is --url an infergate server?",
    "body": "Hint: if the model's outputs are that large, raise bench's --max-answer-mb",
}


def _refused(refusal: Refusal) -> str:
    """An answer past the limits, said with what to check."""
    return f"{refusal.message}. {_REFUSED_HINTS[refusal.part]}"


async def _send(collector: Collector, conn: RawConnection, prepared: bytes, since: float) -> bool:
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
    if response.refused is not None:  # (its connection is closed: the rest is not read)
        collector.fail("no_answer", None, _refused(response.refused))
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


async def _connect(target: Target, plan: Plan) -> tuple[RawConnection, bytes]:
    limits = AnswerLimits(body_bytes=plan.max_answer_mb << 20, kept_bytes=KEPT_BODY_BYTES)
    conn = await RawConnection.open(target.url, limits)
    return conn, conn.request_bytes("POST", target.path, target.body, target.headers)


async def _closed_loop(
    target: Target, concurrency: int, plan: Plan, collector: Collector, stop: asyncio.Event
) -> None:
    async def client() -> None:
        link: tuple[RawConnection, bytes] | None = None
        try:
            while not stop.is_set():
                if link is None:
                    try:
                        link = await _connect(target, plan)
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
    target: Target, rate: float, plan: Plan, collector: Collector, stop: asyncio.Event
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
                link = await _connect(target, plan)
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
            except TimeoutError:
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


async def run_level(
    target: Target,
    mode: Mode,
    level: float,
    plan: Plan,
    on_progress: OnProgress | None = None,
    server_split: SplitReader | None = None,
) -> LoadResult:
    """Drive one level of load and measure it in windows: a fixed number, or until the last
    three agree (at most `plan.max_windows`); the result merges the windows it reports."""
    collector = Collector()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()
    loop.set_exception_handler(_quiet_connection_errors(handler))
    try:
        bounded = _bounded_split(server_split) if server_split else None
        return await _run_level(target, mode, level, plan, collector, stop, on_progress, bounded)
    finally:
        loop.set_exception_handler(handler)


def _bounded_split(read: SplitReader) -> SplitReader:
    """`read` within SPLIT_TIMEOUT_S, None for an answer it cannot read; after one read
    that ran out (a server that stopped answering), None at once: a stalled statistics
    endpoint costs the level its split and SPLIT_TIMEOUT_S, not a wait per window."""
    stalled = False

    async def bounded() -> Totals | None:
        nonlocal stalled
        if stalled:
            return None
        try:
            return await asyncio.wait_for(read(), SPLIT_TIMEOUT_S)
        except TimeoutError:
            stalled = True
            return None
        except ValueError:  # an answer that is not HTTP (one past the limits is no 200)
            return None

    return bounded


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
    collector: Collector,
    stop: asyncio.Event,
    on_progress: OnProgress | None,
    server_split: SplitReader | None,
) -> LoadResult:
    if mode == "concurrency":
        load = asyncio.create_task(_closed_loop(target, int(level), plan, collector, stop))
    else:
        load = asyncio.create_task(_open_loop(target, level, plan, collector, stop))
    started = time.perf_counter()
    windows: list[Window] = []
    marks = [await server_split()] if server_split else []
    if marks:  # the first window starts at the first mark: what was answered before it
        collector.take()  # (while the server was asked) is not in the split, nor measured
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
        if plan.windows is None and is_stable(windows, plan.stability_pct):
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
    result = replace(merge(mode, level, counted, stable), windows_measured=len(windows))
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
