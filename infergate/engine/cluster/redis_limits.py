"""Tenant limits shared by every replica through Redis.

The rate is one GCRA per tenant and the concurrency a set of leases per tenant, checked
together in one Lua script (scripts.ADMIT) that reads Redis's clock: the one round trip a
request waits for. Its lease's release is written before its answer is sent, without
waiting for Redis to confirm it (channel.py). Leases are renewed on a timer, all of this
replica's in one call (every TTL/3, with its heartbeat), so the slots of a replica that
dies are free again within one TTL; a replica that stops releases its own.

Redis being slow or gone never stalls a request: every call is bounded by the socket
timeout and made without retries, a breaker stops calling a Redis that keeps failing,
and the decision is then taken here by `fail_mode` (local share, open or closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from redis.exceptions import NoScriptError, ResponseError

from infergate.clock import Clock
from infergate.engine.admission.breaker import Breaker, BreakerPolicy
from infergate.engine.admission.breaker import State as BreakerState
from infergate.engine.admission.tenants import NO_CONCURRENCY_LIMIT, Tenants, TenantState
from infergate.engine.cluster import scripts
from infergate.engine.cluster.channel import Channel
from infergate.engine.cluster.local_share import LocalShares, Share
from infergate.engine.cluster.metrics import ClusterMetrics
from infergate.engine.cluster.settings import ClusterSettings
from infergate.errors import Overloaded, RedisUnavailable

log = logging.getLogger("infergate.cluster")
T = TypeVar("T")

# Opens within a few tenths of a second of most calls failing (the window is short, so
# the successes from before an outage soon leave it). While it is open, no request calls
# Redis: a background probe does (half-open), after 0.5 s, then up to every 5 s.
REDIS_BREAKER = BreakerPolicy(
    window_seconds=0.3,
    buckets=3,
    failure_rate=0.5,
    latency_p99_ms=math.inf,  # a slow answer is a timeout, counted as a failure
    consecutive_windows=1,
    min_requests=2,
    backoff_initial_s=0.5,
    backoff_max_s=5.0,
    probes=1,
)
_BREAKER_GAUGE = {"closed": 0, "half_open": 1, "open": 2}


@dataclass
class Ticket:
    """One admitted request; `SharedLimits.release` ends it."""

    state: TenantState
    lease_key: str | None = None  # the sorted set holding its lease in Redis
    lease_id: str | None = None
    share: Share | None = None  # the local share whose slot it holds (fail_mode local)


def _admitted(ticket: Ticket) -> Ticket:
    """Counted in the tenant's own state too (this replica's part, for the admin API)."""
    ticket.state.admitted += 1
    ticket.state.concurrency.active += 1
    return ticket


def admit_answer(reply: Any) -> tuple[int, int]:
    """The admission script's [code, wait] as Redis answered it; anything else is Redis
    failing (ResponseError: the breaker and fail_mode take over), never an admission: a
    server answering +OK was read as code 79 and admitted everything, :0 was a 500."""
    if (
        isinstance(reply, (list, tuple))
        and len(reply) == 2
        and all(type(x) is int for x in reply)
        and reply[0] in (0, 1, 2)
        and reply[1] >= 0
    ):
        return reply[0], reply[1]
    raise ResponseError(f"the admission script answered {reply!r:.80}, not [code, wait]")


async def _bounded(call: Awaitable[T], seconds: float) -> T:
    async with asyncio.timeout(seconds):  # no task per call, unlike wait_for before 3.12
        return await call


class SharedLimits:
    def __init__(
        self, settings: ClusterSettings, tenants: Tenants, metrics: ClusterMetrics, clock: Clock
    ) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.settings = settings
        self._tenants = tenants
        self._metrics = metrics
        self._redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.socket_timeout_ms / 1000,
            socket_connect_timeout=settings.connect_timeout_ms / 1000,
            retry=Retry(NoBackoff(), 0),  # a retry would double the wait; we fall back
        )
        # The request path's calls (admission, release) go through the channel; the rest
        # (renewals, probes, the release at stop) through the client.
        self._channel = Channel(
            settings.redis_url,
            settings.connect_timeout_ms / 1000,
            lambda exc: self._failed_quietly("release", exc),
        )
        self._admit_sha = hashlib.sha1(scripts.ADMIT.encode()).hexdigest()
        # register_script loads the script once and again after a NOSCRIPT (a restarted
        # Redis, SCRIPT FLUSH); _run_admit does the same for the admission script.
        self._renew = self._redis.register_script(scripts.RENEW)
        self._timeout_s = settings.socket_timeout_ms / 1000
        self._ttl_us = int(settings.lease_ttl_s * 1e6)
        self.replica = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._held: dict[str, str] = {}  # lease id -> its sorted set
        self._stopping = False  # from then on `stop` releases what is held, in one go
        self._shares = LocalShares(clock)
        self.replicas_seen = 1
        self.breaker = Breaker(REDIS_BREAKER, clock, self._on_breaker)
        self._renewer: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._not_closed = asyncio.Event()  # wakes the prober: it sleeps while Redis answers
        metrics.breaker_state.set(0)
        metrics.replicas.set(1)

    def _on_breaker(self, state: BreakerState, reason: str) -> None:
        self._metrics.breaker_state.set(_BREAKER_GAUGE[state])
        log.warning("the breaker around Redis is %s: %s", state.replace("_", "-"), reason)
        if state != "closed":
            self._not_closed.set()

    def _key(self, tenant: str, kind: str) -> str:
        return f"{self.settings.key_prefix}:{kind}:{tenant}"

    # -- admission ---------------------------------------------------------------------

    async def admit(self, state: TenantState, model: str) -> Ticket:
        """Allow-list, rate and concurrency, as Tenants.admit, across every replica."""
        self._tenants.check_allowed(state, model)
        tenant = state.tenant
        rated = math.isfinite(tenant.rps)
        slots = tenant.max_concurrency if tenant.max_concurrency != NO_CONCURRENCY_LIMIT else 0
        if not rated and not slots:  # nothing to share: no round trip
            return _admitted(Ticket(state))
        if rated and tenant.rps <= 0:  # never a token: no need to ask
            self._tenants.refuse_rate(state, math.inf)
        if self.breaker.state != "closed":  # open, or half-open: the prober's turn
            return self._without_redis(state)
        admission = self.breaker.allow()
        interval = 1e6 / tenant.rps if rated else 0.0
        lease_id = f"{self.replica}:{next(self._ids)}" if slots else ""
        lease_key = self._key(tenant.name, "leases")
        try:
            code, wait_us = await self._call(
                "admit",
                self._ask(
                    self._key(tenant.name, "tat"),
                    lease_key,
                    f"{interval:.3f}",
                    f"{(tenant.burst - 1) * interval:.3f}" if rated else "0",
                    slots,
                    lease_id,
                ),
            )
        except RedisUnavailable:
            self.breaker.record(admission, False, None)
            return self._without_redis(state)
        self.breaker.record(admission, True, None)
        if code == 0:
            self._tenants.refuse_rate(state, wait_us / 1e6)
        if code == 2:
            self._tenants.refuse_concurrency(state)
        if not slots:
            return _admitted(Ticket(state))
        self._held[lease_id] = lease_key
        return _admitted(Ticket(state, lease_key, lease_id))

    async def _ask(
        self, tat_key: str, lease_key: str, interval: str, tolerance: str, slots: int, lease: str
    ) -> tuple[int, int]:
        """The admission script's answer: (1, 0) admitted, (0, wait) over the rate, (2, 0)
        no free slot. No free slot is asked again once, without the rate (its token is
        taken): Redis serves the commands waiting on different connections in no set
        order, so the release another replica wrote before answering this client's
        previous request can come after this request's admission when both wait for
        Redis together; by the time that admission's answer is back, Redis has read the
        release too."""
        code, wait_us = await self._run_admit(
            tat_key, lease_key, interval, tolerance, slots, self._ttl_us, lease
        )
        if code == 2:
            self._metrics.asked_again.inc()
            code, wait_us = await self._run_admit(
                tat_key, lease_key, "0", "0", slots, self._ttl_us, lease
            )
        return int(code), int(wait_us)

    async def _run_admit(self, *keys_and_args: str | int) -> tuple[int, int]:
        """The admission script (two keys, then its arguments), loaded again if Redis
        forgot it."""
        try:
            reply = await self._channel.call(
                self._channel.pack("EVALSHA", self._admit_sha, 2, *keys_and_args)
            )
        except NoScriptError:
            await self._channel.call(self._channel.pack("SCRIPT", "LOAD", scripts.ADMIT))
            reply = await self._channel.call(
                self._channel.pack("EVALSHA", self._admit_sha, 2, *keys_and_args)
            )
        return admit_answer(reply)

    def _without_redis(self, state: TenantState) -> Ticket:
        mode = self.settings.fail_mode
        counter = self._metrics.without_redis
        if mode == "open":
            counter.labels(mode, "admitted").inc()
            return _admitted(Ticket(state))
        if mode == "closed":
            counter.labels(mode, "refused").inc()
            raise Overloaded(
                f"the limits of tenant {state.tenant.name!r} are shared through Redis, "
                'which does not answer, and cluster.fail_mode is "closed"; retry in 1 s. '
                'Hint: check Redis (cluster.redis_url), or set fail_mode = "local"'
            )
        share = self._shares.get(state.tenant, max(self.settings.replicas, self.replicas_seen))
        wait = share.bucket.try_take()
        if wait > 0:
            counter.labels(mode, "refused").inc()
            self._tenants.refuse_rate(state, wait)
        if not share.concurrency.try_enter():
            counter.labels(mode, "refused").inc()
            self._tenants.refuse_concurrency(state)
        counter.labels(mode, "admitted").inc()
        return _admitted(Ticket(state, share=share))

    async def release(self, ticket: Ticket) -> None:
        """End an admitted request, before it is answered: a client that sends one request
        after another must never find its previous request's slot still taken (a release
        in the background, after the answer, lost that race; see
        tests/test_cluster_limits.py). The release is written to Redis here, and its reply
        read with the next admission on the same connection: no request waits for it.

        A release that does not reach Redis (it is down, or the breaker is open) leaves
        the lease to expire, at most one TTL after its last renewal: a slot is only ever
        freed late, never early, so the limit can only get stricter meanwhile."""
        ticket.state.concurrency.leave()
        if ticket.share is not None:
            ticket.share.concurrency.leave()
        if ticket.lease_id is None or ticket.lease_key is None:
            return
        lease_key, lease_id = ticket.lease_key, ticket.lease_id
        if self._stopping:
            # Requests cut off by the end of a drain land here while `stop` closes the
            # client: their leases stay held, and `stop` releases them all in one go.
            return
        if self.breaker.state == "closed":
            # Forgotten only once released (or failed: then it expires within one TTL):
            # a request cut off by the end of a drain is cancelled here again, and
            # `stop` must still find its lease.
            try:
                written = await self._call(
                    "release", self._channel.send(self._channel.pack("ZREM", lease_key, lease_id))
                )
                if not written:  # no connection open: Redis went away since the admission
                    self._metrics.redis_errors.labels("release").inc()
            except RedisUnavailable:
                pass
            except RuntimeError:  # uvloop, on a connection `stop` closed meanwhile
                if not self._stopping:
                    raise
                return
        self._held.pop(lease_id, None)

    async def _call(self, op: str, call: Awaitable[Any]) -> Any:
        try:
            return await _bounded(call, self._timeout_s)
        except (TimeoutError, OSError) as exc:
            self._failed(op, exc)
        except Exception as exc:  # redis.RedisError and its kin: not worth a request
            if type(exc).__module__.split(".")[0] != "redis":
                raise
            self._failed(op, exc)

    def _failed(self, op: str, exc: BaseException) -> NoReturn:
        self._failed_quietly(op, exc)
        raise RedisUnavailable(op) from exc

    def _failed_quietly(self, op: str, exc: BaseException) -> None:
        self._metrics.redis_errors.labels(op).inc()
        log.debug("redis %s failed: %r", op, exc)

    # -- leases and heartbeat --------------------------------------------------------

    async def start(self) -> None:
        """Load the scripts and open a connection now, so the first request does not pay
        for it within its short timeout (a Redis that is not there yet is retried by the
        first requests and the renewal loop)."""
        with contextlib.suppress(Exception):
            await _bounded(self._load_scripts(), max(1.0, self._timeout_s))
        with contextlib.suppress(Exception):  # the request path's first connection
            await _bounded(
                self._channel.call(self._channel.pack("PING")), max(1.0, self._timeout_s)
            )
        self._renewer = asyncio.create_task(self._renew_forever(), name="cluster:renew")
        self._prober = asyncio.create_task(self._probe_forever(), name="cluster:probe")

    async def _load_scripts(self) -> None:
        await self._redis.script_load(scripts.ADMIT)
        await self._redis.script_load(scripts.RENEW)

    async def _renew_forever(self) -> None:
        period = self.settings.lease_ttl_s / 3
        while True:
            with contextlib.suppress(RedisUnavailable):
                await self.renew()
            await asyncio.sleep(period)

    async def _probe_forever(self) -> None:
        """Requests never probe a Redis that failed (each would risk the timeout): this
        does, when the breaker turns half-open. While it is closed the prober sleeps: no
        timer wakes the event loop 20 times a second beside the requests."""
        while True:
            if self.breaker.state == "closed":
                self._not_closed.clear()
                await self._not_closed.wait()
            await asyncio.sleep(0.05)
            if self.breaker.state != "half_open" or self.breaker.allow() != "probe":
                continue
            try:
                await self._call("probe", self._redis.ping())
            except RedisUnavailable:
                self.breaker.record("probe", False, None)
            else:
                self.breaker.record("probe", True, None)

    async def renew(self) -> None:
        held = list(self._held.items())
        seen = await self._call(
            "renew",
            self._renew(
                keys=[self._key("", "replicas"), *(key for _, key in held)],
                args=[self._ttl_us, self.replica, *(lease for lease, _ in held)],
            ),
        )
        self.replicas_seen = max(1, int(seen))
        self._metrics.replicas.set(self.replicas_seen)

    async def stop(self) -> None:
        """Release what this replica still holds (requests cut off by the end of a drain)
        and leave the replicas' count."""
        self._stopping = True
        for task in (self._renewer, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._channel.close()  # the releases written on it are still delivered
        with contextlib.suppress(RedisUnavailable):
            await self._call("release", self._release_all())
        await self._redis.aclose()

    async def _release_all(self) -> None:
        async with self._pipeline() as pipe:
            for lease, key in self._held.items():
                pipe.zrem(key, lease)
            pipe.zrem(self._key("", "replicas"), self.replica)
            await pipe.execute()
        self._held.clear()

    @contextlib.asynccontextmanager
    async def _pipeline(self) -> AsyncIterator[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            yield pipe
