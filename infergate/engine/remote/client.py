"""Reaching a remote model's endpoints: a connection pool per endpoint, the balancer
and outlier detector in front of them, and `forward`, which sends one request with
retries on another endpoint.

Only two failures are retried, as neither can have run the model twice: a connection that
could not be opened, and a 503 (the upstream said it did not take the request). Answers
are read in full before anything goes back to the client, so a 503 is always "before any
body". Each retry takes a share of the retry budget, so a sick cluster is not sent
twice the load.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from infergate.clock import Clock
from infergate.engine.remote.balancer import Balancer, RetryBudget
from infergate.engine.remote.config import RemoteConfig
from infergate.engine.remote.health import HealthChecks
from infergate.engine.remote.http1 import Http1Pool, Payload, Reply, Sender
from infergate.engine.remote.metrics import RemoteMetrics
from infergate.engine.remote.outlier import OutlierDetector, OutlierPolicy
from infergate.engine.remote.slots import Turn
from infergate.errors import (
    BrokenReply,
    ConnectFailed,
    ControlFailed,
    DeadlineExceeded,
    InfergateError,
    PoolTimeout,
    QueueDeadlineExceeded,
    UpstreamAnswered,
    UpstreamFailed,
)

# Headers that describe the body: forwarded both ways, unchanged. (Content-Encoding is not
# among them: the body upstream is the inflated one, and we never ask upstream to compress.)
BODY_HEADERS = ("content-type", "inference-header-content-length")
CONTROL_BODY_BYTES = 4 << 20  # a control answer (metadata, readiness, health) at most


@dataclass(frozen=True)
class UpstreamReply:
    status: int
    headers: list[tuple[bytes, bytes]]  # BODY_HEADERS the upstream sent, and retry-after
    body: bytes
    endpoint: str
    attempts: int


class RemotePool:
    def __init__(
        self,
        config: RemoteConfig,
        clock: Clock,
        on_event: Callable[[str, str], None] | None = None,
        rng: random.Random | None = None,
        sender: Callable[[str], Sender] | None = None,
        metrics: RemoteMetrics | None = None,
        model: str = "",
    ) -> None:
        self.config = config
        self._clock = clock
        self._event = on_event or (lambda kind, text: None)
        self._metrics = metrics
        self._model = model
        endpoints = list(config.endpoints)
        if metrics is not None:
            for e in endpoints:
                metrics.healthy.labels(model, e).set(1)
                metrics.ejected.labels(model, e).set(0)
        self.health = HealthChecks(
            endpoints, config.unhealthy_threshold, config.healthy_threshold, self._health_changed
        )
        self.outliers = OutlierDetector(
            endpoints,
            OutlierPolicy(
                config.consecutive_5xx,
                config.interval_s,
                config.base_ejection_time_s,
                config.max_ejection_time_s,
                config.max_ejection_percent,
            ),
            clock,
            self._ejection_changed,
        )
        self.balancer = Balancer(endpoints, self.health, self.outliers, rng)
        self.budget = RetryBudget(config.retry_budget_percent, config.min_retry_concurrency)
        # Control calls (metadata, readiness, health) and requests each through their own
        # HTTP/1.1 pools (http1.py says why): a few control connections an endpoint, their
        # answers at most CONTROL_BODY_BYTES.
        self._control = {
            e: Http1Pool(e, 4, 1, CONTROL_BODY_BYTES, too_large_hint="") for e in endpoints
        }
        answer_max = config.max_answer_mb << 20
        make = sender or (
            lambda e: Http1Pool(e, config.max_connections, config.max_keepalive, answer_max)
        )
        self._senders = {e: make(e) for e in endpoints}

    def _health_changed(self, endpoint: str, healthy: bool, why: str) -> None:
        self._event("remote_healthy" if healthy else "remote_unhealthy", f"{endpoint}: {why}")
        if self._metrics is not None:
            self._metrics.healthy.labels(self._model, endpoint).set(int(healthy))

    def _ejection_changed(self, endpoint: str, ejected: bool, why: str) -> None:
        self._event("remote_ejected" if ejected else "remote_returned", f"{endpoint}: {why}")
        if self._metrics is not None:
            self._metrics.ejected.labels(self._model, endpoint).set(int(ejected))
            if ejected:
                self._metrics.ejections.labels(self._model, endpoint).inc()

    def _count(self, endpoint: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.attempts.labels(self._model, endpoint, outcome).inc()

    def _retry(self, why: str) -> None:
        if self._metrics is not None:
            self._metrics.retries.labels(self._model, why).inc()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._control.values()))
        await asyncio.gather(*(s.close() for s in self._senders.values()))

    async def get(self, endpoint: str, path: str, timeout_s: float) -> Reply:
        """A control request (metadata, readiness, health) to one endpoint: all of it within
        `timeout_s` (a body dripping a byte at a time held a health round for good when
        each read was bounded, not the answer), its body at most CONTROL_BODY_BYTES (an
        endless one grew the gateway by gigabytes). ControlFailed says why not."""
        connect_s = min(timeout_s, self.config.connect_timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._control[endpoint].request(
                    path, {}, b"", connect_s, timeout_s, method="GET"
                )
        except TimeoutError:
            raise ControlFailed(f"GET {path}: no whole answer within {timeout_s:g} s") from None
        except (ConnectFailed, BrokenReply, PoolTimeout) as exc:
            raise ControlFailed(f"GET {path}: {type(exc).__name__}: {exc}") from None

    async def check_health(self) -> None:
        """One round of active health checks, every endpoint at once, each alone."""

        async def one(endpoint: str) -> None:
            try:
                reply = await self.get(endpoint, "/v2/health/ready", self.config.health_timeout_s)
            except ControlFailed as exc:
                self.health.record(endpoint, False, str(exc))
                return
            self.health.record(endpoint, reply.status == 200, f"HTTP {reply.status}")

        await asyncio.gather(*(one(e) for e in self.config.endpoints))
        self.outliers.maybe_sweep()

    async def forward(
        self,
        path: str,
        body: Payload,
        headers: dict[str, str],
        start_by: float,
        finish_by: float,
        turn: Turn = (0, None),
    ) -> UpstreamReply:
        """POST `body` to `path` on the best endpoint. `start_by` (clock time) bounds the
        wait for a connection (the request's queue deadline: it has not started yet), in
        `turn` (its class rank and tenant: slots.py); `finish_by` bounds the whole
        exchange, retries included (the model's timeout)."""
        budget, tried = self.budget, list[str]()
        last: InfergateError | None = None
        retrying = False
        budget.requests += 1
        try:
            while True:
                endpoint = self.balancer.pick(tried)
                if last is not None:  # this would be a retry: is one allowed?
                    if (
                        endpoint is None
                        or len(tried) > self.config.retries
                        or (not retrying and not budget.try_acquire())
                    ):
                        self._retry("refused")
                        raise last
                    retrying = True
                    self._retry("503" if isinstance(last, UpstreamAnswered) else "connect_failed")
                assert endpoint is not None  # the first pick has every endpoint to choose
                tried.append(endpoint)
                try:
                    reply = await self._attempt(
                        endpoint, path, body, headers, start_by, finish_by, turn
                    )
                except UpstreamFailed as exc:
                    if not exc.retriable:
                        raise
                    last = exc
                    continue
                if reply.status == 503:
                    last = answered(reply)
                    continue
                return UpstreamReply(reply.status, reply.headers, reply.body, endpoint, len(tried))
        finally:
            budget.requests -= 1
            if retrying:
                budget.release()

    async def _attempt(
        self,
        endpoint: str,
        path: str,
        body: Payload,
        headers: dict[str, str],
        start_by: float,
        finish_by: float,
        turn: Turn,
    ) -> UpstreamReply:
        now = self._clock.now()
        if now >= start_by:
            raise QueueDeadlineExceeded(
                "the request's deadline passed before an upstream connection was free. "
                "Hint: raise the class deadline or [remote] max_connections"
            )
        total = finish_by - now
        if total <= 0:
            raise DeadlineExceeded(f"the model's timeout passed before {endpoint} answered")
        wait = start_by - now
        self.balancer.started(endpoint)
        try:
            reply = await asyncio.wait_for(
                self._senders[endpoint].request(
                    path, headers, body, min(self.config.connect_timeout_s, wait), wait, turn
                ),
                total,
            )
        except PoolTimeout:
            self._count(endpoint, "pool_timeout")
            raise QueueDeadlineExceeded(
                f"no connection to {endpoint} came free before the request's deadline "
                f"({self.config.max_connections} in use). Hint: raise [remote] max_connections"
            ) from None
        except ConnectFailed as exc:
            self.outliers.failure(endpoint)
            self._count(endpoint, "connect_failed")
            raise _failed(endpoint, exc, retriable=True) from None
        except TimeoutError:
            self.outliers.failure(endpoint)
            self._count(endpoint, "timeout")
            raise DeadlineExceeded(
                f"{endpoint} did not answer within the model's timeout ({total:.3g} s left). "
                "Hint: timeout_ms in model.toml"
            ) from None
        except BrokenReply as exc:
            self.outliers.failure(endpoint)
            self._count(endpoint, "broken")
            raise _failed(endpoint, exc, retriable=False) from None
        finally:
            self.balancer.finished(endpoint)
        self._count(endpoint, f"{reply.status // 100}xx")
        if reply.status >= 500:
            self.outliers.failure(endpoint)
        else:
            self.outliers.success(endpoint)
        kept = passed_on(reply.headers)
        return UpstreamReply(reply.status, kept, reply.body, endpoint, 1)


def passed_on(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The upstream's headers that go on to our client (the body's, and Retry-After),
    without values holding control characters: they are written into our answer."""
    return [
        (name.encode(), value.encode())
        for name in (*BODY_HEADERS, "retry-after")
        if (value := headers.get(name)) is not None and value.isascii() and value.isprintable()
    ]


def _failed(endpoint: str, exc: Exception, retriable: bool) -> UpstreamFailed:
    return UpstreamFailed(f"upstream {endpoint} failed: {type(exc).__name__}: {exc}", retriable)


_MAX_RETRY_AFTER_S = 86_400.0


def answered(reply: UpstreamReply) -> UpstreamAnswered:
    """An upstream error answer as our error, its message kept."""
    try:
        doc = orjson.loads(reply.body)
        text = doc.get("error") if isinstance(doc, dict) else None
    except orjson.JSONDecodeError:
        text = None
    message = str(text) if text else reply.body[:200].decode("utf-8", "replace")
    retry_after = next((v for k, v in reply.headers if k == b"retry-after"), None)
    seconds = None
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:
            seconds = None
        if seconds is not None and not 0 <= seconds <= _MAX_RETRY_AFTER_S:  # nan, inf, -1
            seconds = None
    said = f"upstream {reply.endpoint} answered {reply.status}: {message}"
    if not 400 <= reply.status <= 599:  # not an error status a client could act on
        return UpstreamAnswered(502, f"{said} (not an HTTP error status)", None)
    return UpstreamAnswered(reply.status, said, seconds)
