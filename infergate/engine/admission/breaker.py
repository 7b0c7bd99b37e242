"""Circuit breakers per model version, on an injected clock.

Outcomes and latencies go into a sliding window of time buckets. Every bucket's length an
evaluation asks: over the window, is the failure rate above `failure_rate` (once there are
`min_requests`), or the p99 above `latency_p99_ms`? `consecutive_windows` such answers in a
row open the breaker. Open: requests are refused (503 with Retry-After) for a backoff that
doubles on each reopening up to `backoff_max_s`. Then half-open: `probes` requests go
through; if they all succeed the breaker closes (and the backoff resets), one failure
reopens it.

    closed --(bad for N evaluations)--> open --(backoff)--> half_open
       ^                                  ^                     |
       +----------(probes succeed)--------+----(a probe fails)--+

A breaker judges the model, not one tenant's requests: outcomes carry their tenant, and
when a window is bad only because of one tenant's requests, that tenant alone is cut off
for a backoff of its own (doubling while it keeps at it) and the breaker stays closed for
the others: one tenant's inputs that make the model raise, crash or run slow cannot close
it to everyone. "Only because of one tenant's": either other tenants' requests came in the
window and, without that one's, are within the limits; or no other tenant's requests came
in it at all, and the model served another tenant's request well (a success, within the
latency limit) since the breaker last opened: the model has shown it works for others,
and they are who the cut-off keeps it open for. A window of one tenant's requests where
no other tenant was served opens it for everyone (a deployment without tenants, where
every request is the default tenant's, or a model only that tenant uses): with nobody
shown to be served well, and perhaps nobody to protect, it cannot tell the tenant from
the model.

Several tenants failing are cut off together, or one more (its failures, or a query of
death) while another is cut off already, only on the window's evidence: the other tenants'
requests in it, at least `min_requests` of them, within the limits without theirs. Else
(one more failing alone in the window, a failed probe, too few others' requests to tell)
a second tenant failing opens it for everyone: the model may fail for all. Once, two tenants
failing opened it for everyone whatever the others' requests showed: one sender with two
tenants' keys, both failing while a victim sent 5 requests a second, kept the victim at
124 of 296 requests served over 60 s; now 262 of 297, all 35 refused in the first
10 s, before the window held `min_requests` (20) of the victim's.

A cut-off tenant's backoff doubles past `backoff_max_s`, to `CUT_OFF_MAX_S` (10 minutes):
only that tenant waits it out, and a worker restarted after a query of death counts as
stable (its restart backoff back to the shortest) after 60 s of life. Capped at 30 s, one
tenant's query of death a second kept a shared single-instance model restarting every
30 s at its longest restart backoff (10 s): 36% of another tenant's requests failed.

Half-open, a probe that fails once another tenant's probe has succeeded cuts off its own
tenant, not the model: otherwise a tenant sending failing requests as fast as another's
succeed kept the breaker open for both, each of its probes reopening it (a 5 requests/s
attacker held a victim at 100% 503s for 45 s). And a tenant whose probe failed since the
breaker opened waits `PROBE_GRACE_S` into each half-open period while the other tenants'
requests probe: a sender with two tenants' keys, timing a failing request to be the
first probe of every half-open period, reopened it each time before another tenant's
probe could succeed (a victim served 14 of 595 requests over 110 s). Alone (the default
tenant), it probes after the grace.

A cut-off tenant's outcomes do not count while its cut-off lasts: its requests admitted
before it (in flight then) end afterwards, and counted they would make the window bad
again, as a second tenant failing it, and open it for the others.

Which tenant a bad window blames, and how a batch several tenants shared counts: see
breaker_blame.py.

A query of death: a request that ran alone (a batch of its own) and ended its worker (a
crash, a kill for its memory or past its timeout) is its tenant's doing. A tenant whose
requests end `WORKER_DEATHS` workers of the version within `window_seconds` is cut off as
above, without waiting for `min_requests` (the requests refused while the model restarts
never reach the window), once the model served another tenant well since it last opened
(while another tenant is cut off, it opens for everyone instead); such a request gets no
other try on a sibling, which it would end too. Where nobody else was served (the default
tenant alone), nobody is cut off, and a lone request that ended its worker gets its try
unless its tenant ended another worker within the window.

The window's cost does not grow with the traffic: the latency verdict counts, in each
bucket, the latencies measured and those above `latency_p99_ms` (the p99 is above the
limit exactly when more than 1% of them are), and keeps a uniform sample of at most
`SAMPLES` latencies a bucket for the p99 it shows (all of them, below that). Keeping every
latency, as it did, held 60 s of traffic (700,000 floats at 12,000 requests/s) and sorted
them all at each evaluation, stalling the event loop for a tenth of a second every 6 s.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import groupby
from typing import Literal

from infergate.clock import Clock
from infergate.engine.admission.breaker_blame import (
    Bucket,
    culprits,
    only_shared_went_wrong,
    p99,
    p99_above,
    served_well_without,
)

State = Literal["closed", "open", "half_open"]
Admission = Literal["refused", "normal", "probe"]


@dataclass(frozen=True)
class BreakerPolicy:
    # Each setting's bounds and meaning: infergate/settings/profile_sections.py (BreakerSection).
    window_seconds: float = 60.0
    failure_rate: float = 0.05
    latency_p99_ms: float = 1500.0
    consecutive_windows: int = 3
    min_requests: int = 20
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    probes: int = 3
    buckets: int = 10  # an implementation detail: no setting declares it


# Workers of a version a tenant's lone requests may end within the window before it is cut
# off (a query of death): one may be chance, a second is its inputs.
WORKER_DEATHS = 2
CUT_OFF_MAX_S = 600.0  # a cut-off tenant's longest backoff (see the module docstring)
# Half-open, for this long the tenants whose probes failed since it opened wait, and the
# other tenants' requests are the probes (see the module docstring).
PROBE_GRACE_S = 2.0


@dataclass(slots=True)
class _CutOff:
    """A tenant refused on its own: until when, after what backoff, and why."""

    until: float
    backoff: float
    reason: str


class Breaker:
    def __init__(
        self,
        policy: BreakerPolicy,
        clock: Clock,
        on_change: Callable[[State, str], None] | None = None,
        on_cut_off: Callable[[Hashable, str, float], None] | None = None,
    ) -> None:
        self.policy = policy
        self._on_change = on_change
        self._clock = clock
        self._state: State = "closed"
        self.reason = ""
        self._buckets: deque[Bucket] = deque()
        self._bad_evaluations = 0
        self._bucket_s = policy.window_seconds / policy.buckets
        self._next_evaluation = clock.now() + self._bucket_s
        self._open_until = 0.0
        self._backoff = policy.backoff_initial_s
        self._probes_left = 0
        self._probes_ok = 0
        self._limit_s = policy.latency_p99_ms / 1000
        self._random = random.Random(0)  # which latencies a full bucket keeps
        self._cut: dict[Hashable, _CutOff] = {}  # tenants refused on their own
        self._on_cut_off = on_cut_off
        # Called, with how long, when only the batches tenants shared went wrong and it
        # cannot tell whose rows did it: its version batches each tenant apart meanwhile.
        self.on_unclear: Callable[[float], None] | None = None
        # The last two distinct tenants served well since the breaker last opened (None:
        # none yet): is there another tenant than one failing alone that the model serves?
        self._served: Hashable = None
        self._opened_for = ""  # why it last opened from closed (probes that fail since name it)
        self._failed_probers: set[Hashable] = set()  # since it opened: see PROBE_GRACE_S
        self._half_open_at = 0.0
        self._served_before: Hashable = None
        # When each tenant's lone requests ended a worker, within the window (oldest first).
        self._deaths: dict[Hashable, deque[float]] = {}

    @property
    def state(self) -> State:
        self._tick()
        return self._state

    def reconfigure(self, policy: BreakerPolicy) -> None:
        """A new policy; latencies already counted stay counted against the limit in force
        when they came, so a new `latency_p99_ms` fully applies one window later."""
        self.policy = policy
        self._limit_s = policy.latency_p99_ms / 1000
        self._bucket_s = policy.window_seconds / policy.buckets
        self._backoff = min(self._backoff, policy.backoff_max_s)

    def _move(self, state: State, reason: str) -> None:
        self._state, self.reason = state, reason
        if self._on_change is not None:
            self._on_change(state, reason)

    def retry_after(self, tenant: Hashable = None) -> float:
        now = self._clock.now()
        cut = self._cut.get(tenant) if self._cut else None
        own = 0.0 if cut is None else cut.until - now
        if self._state == "half_open" and tenant in self._failed_probers:
            own = max(own, self._half_open_at + PROBE_GRACE_S - now)
        return max(0.0, self._open_until - now, own)

    def cut_off(self, tenant: Hashable) -> str | None:
        """Why `tenant` is refused on its own now, or None when it is not."""
        cut = self._cut.get(tenant) if self._cut else None
        if cut is None or self._clock.now() >= cut.until:
            return None
        return cut.reason

    def _cut_now(self, tenant: Hashable, now: float) -> bool:
        cut = self._cut.get(tenant)
        return cut is not None and now < cut.until

    def cut_off_tenants(self) -> dict[Hashable, float]:
        """The tenants refused on their own now, with the seconds left."""
        now = self._clock.now()
        return {t: c.until - now for t, c in self._cut.items() if c.until > now}

    def allow(self, tenant: Hashable = None) -> Admission:
        """May a request of `tenant` go through now? In half-open, the few let through
        are probes (never a tenant's that is cut off: it cannot keep the breaker open)."""
        if self._state != "closed" or self._clock.now() >= self._next_evaluation:
            self._tick()  # (closed, before its next evaluation: nothing to do)
        if self._cut and self.cut_off(tenant) is not None:
            return "refused"
        if self._state == "closed":
            return "normal"
        if self._state == "half_open" and self._probes_left > 0:
            if self._failed_probers and tenant in self._failed_probers and self._graced():
                return "refused"  # the others' turn to probe first
            self._probes_left -= 1
            return "probe"
        return "refused"

    def _graced(self) -> bool:
        return self._clock.now() < self._half_open_at + PROBE_GRACE_S

    def unjudged(self, admission: Admission) -> None:
        """A request `allow` let through ended with no outcome to judge (cancelled: its
        client left, or the gateway stops): a probe's place is given back, or a breaker
        whose probes' clients all left would stay half-open, refusing everyone."""
        if admission == "probe" and self._state == "half_open":
            self._probes_left = min(self._probes_left + 1, self.policy.probes)

    def record(
        self,
        admission: Admission,
        ok: bool,
        latency_s: float | None,
        tenant: Hashable = None,
        shared: frozenset[Hashable] | None = None,
    ) -> None:
        """The outcome of a request of `tenant` that `allow` let through as `admission`,
        with the model's execution latency (None: not measured, e.g. the worker died).
        `shared`: the tenants whose requests shared its batch, when they were several."""
        now = self._clock.now()
        if now >= self._next_evaluation or self._state != "closed":  # else _tick has nothing to do
            self._tick(now)
        if admission == "probe":
            if self._state != "half_open":
                return
            if not ok:
                if (
                    tenant is not None
                    and self._served_another(tenant)
                    and not any(c.until > now for c in self._cut.values())
                ):
                    # Another tenant's probe succeeded: the model works, for them. This
                    # tenant alone is cut off, and its probe's place goes to the others;
                    # a second tenant's failing (one is cut off already) opens it for all.
                    why = "its probe failed while another tenant's succeeded"
                    self._cut_tenant_off(tenant, why, now)
                    self._probes_left = min(self._probes_left + 1, self.policy.probes)
                    return
                if tenant is not None:
                    self._failed_probers.add(tenant)
                self._open(f"a probe failed ({self._opened_for})")
                return
            if tenant is not None and (latency_s is None or latency_s <= self._limit_s):
                self._served_well(tenant)
            self._probes_ok += 1
            if self._probes_ok >= self.policy.probes:
                self._close()
            return
        if self._state != "closed":
            return  # a request from before the breaker opened
        if self._cut and (
            (tenant in self._cut and now < self._cut[tenant].until)
            or (shared is not None and any(self._cut_now(t, now) for t in shared))
        ):
            # Admitted before its cut-off, or batched with a request that was: the others
            # go on as if it had not come.
            return
        buckets = self._buckets
        if buckets and now < buckets[-1].start + self._bucket_s:  # `_current`, inline
            bucket = buckets[-1]
        else:
            bucket = self._current(now)
        slow = latency_s is not None and latency_s > self._limit_s
        if ok:
            bucket.ok += 1
            if tenant is not None and tenant != self._served and not slow:
                self._served_well(tenant)
        else:
            bucket.failed += 1
        if tenant is not None:  # a batch several tenants shared: counted for them together
            key = tenant if shared is None else shared
            bucket.count(key, shared is not None, 1, ok, latency_s is not None, slow)
        if latency_s is not None:
            bucket.measure(latency_s, 1, slow, self._random)

    def record_served(
        self, tenants: list[Hashable], latency_s: float, shared: frozenset[Hashable] | None
    ) -> None:
        """`record("normal", True, latency_s, tenant, shared)` for each of `tenants` in
        turn (the requests a batch answered, admitted as normal ones), at the same moment:
        the same counts, samples and verdicts, for one call a batch instead of one a
        request (it ran for every request, a thirtieth of the gateway's opcodes)."""
        now = self._clock.now()
        if now >= self._next_evaluation or self._state != "closed":
            self._tick(now)
        if self._state != "closed":
            return  # requests from before the breaker opened
        if self._cut and shared is not None and any(self._cut_now(t, now) for t in shared):
            return  # batched with a request of a tenant cut off: as if it had not come
        slow = latency_s > self._limit_s
        bucket = None  # (found once a request counts: as `record`, none when none does)
        for tenant, run in groupby(tenants):
            if self._cut and tenant in self._cut and now < self._cut[tenant].until:
                continue
            if bucket is None:
                bucket = self._current(now)
            count = len(list(run))
            bucket.ok += count
            if tenant is not None:
                if tenant != self._served and not slow:
                    self._served_well(tenant)
                key = tenant if shared is None else shared
                bucket.count(key, shared is not None, count, True, True, slow)
            bucket.measure(latency_s, count, slow, self._random)

    def worker_ended(self, tenant: Hashable, how: str) -> bool:
        """A request of `tenant` that ran alone ended its worker (`how`: what ended it).
        Whether that request may have another try: not when the death counts against its
        tenant (the model served another tenant well since the breaker last opened: it
        would end a sibling too), nor when its tenant ended another worker within the
        window. `WORKER_DEATHS` of them within the window cut the tenant off, as a bad
        window does, whatever `min_requests`."""
        if tenant is None:
            return True  # nobody to tell it by (the outcomes named no tenant)
        now = self._clock.now()
        self._tick(now)
        if self.cut_off(tenant) is not None:
            return False  # admitted before its cut-off, and at it still
        deaths = self._deaths.setdefault(tenant, deque())
        while deaths and deaths[0] <= now - self.policy.window_seconds:
            deaths.popleft()
        before = len(deaths)
        deaths.append(now)
        judged = self._state == "closed" and self._served_another(tenant)
        if judged and len(deaths) >= WORKER_DEATHS:
            why = (
                f"{len(deaths)} workers of this version within "
                f"{self.policy.window_seconds:g} s, each running alone (the last {how})"
            )
            others_cut = any(c.until > now for c in self._cut.values())
            if others_cut and not served_well_without(self._buckets, self.policy, tenant):
                self._open(f"a second tenant's requests ended {why}")  # as `_culprits`
            else:
                self._cut_tenant_off(tenant, f"its requests ended {why}", now)
        return not judged and before == 0

    def _served_well(self, tenant: Hashable) -> None:
        if tenant != self._served:
            self._served_before, self._served = self._served, tenant

    def _served_another(self, tenant: Hashable) -> bool:
        """Whether the model served a tenant other than `tenant` well since the breaker
        last opened."""
        return any(t is not None and t != tenant for t in (self._served, self._served_before))

    def reset(self) -> None:
        self._buckets.clear()
        self._cut.clear()
        self._deaths.clear()
        self._served = self._served_before = None
        self._backoff = self.policy.backoff_initial_s
        self._bad_evaluations = 0
        self._move("closed", "reset by an operator")

    def _current(self, now: float) -> Bucket:
        if not self._buckets or now >= self._buckets[-1].start + self._bucket_s:
            self._buckets.append(Bucket(now))
        return self._buckets[-1]

    def _tick(self, now: float | None = None) -> None:
        if now is None:
            now = self._clock.now()
        if self._state == "open" and now >= self._open_until:
            self._half_open_at = now
            self._move("half_open", self.reason)
            self._probes_left = self.policy.probes
            self._probes_ok = 0
        while now >= self._next_evaluation:
            at = self._next_evaluation
            self._next_evaluation += self._bucket_s
            if self._state == "closed":
                self._evaluate(at)

    def window_stats(self, now: float | None = None) -> tuple[int, int, float | None]:
        """Requests, failures and p99 latency (seconds) in the window ending `now`; the
        p99 is None when no request in it had its latency measured, and is read from the
        buckets' samples: exact up to SAMPLES latencies a bucket."""
        now = self._clock.now() if now is None else now
        while self._buckets and self._buckets[0].start <= now - self.policy.window_seconds:
            self._buckets.popleft()
        ok = sum(b.ok for b in self._buckets)
        failed = sum(b.failed for b in self._buckets)
        latencies = sorted(x for b in self._buckets for x in b.latencies)
        return ok + failed, failed, p99(latencies)

    def _too_slow(self) -> tuple[int, int] | None:
        """The window's (slow, measured) latencies when its p99 is above the limit, else
        None."""
        measured = sum(b.measured for b in self._buckets)
        slow = sum(b.slow for b in self._buckets)
        return (slow, measured) if p99_above(slow, measured) else None

    def _culprits(self, failures: bool, now: float) -> list[tuple[Hashable, str]]:
        """The tenants to cut off for a bad window, and why (breaker_blame.py); none when
        it opens for everyone. While a tenant is cut off already (its outcomes are out of
        the window), only on the other requests' evidence (see the module docstring)."""
        others_cut = any(c.until > now for c in self._cut.values())
        return culprits(self._buckets, self.policy, failures, self._served_another, others_cut)

    def _cut_tenant_off(self, tenant: Hashable, reason: str, now: float) -> None:
        """Refuse `tenant` alone for a while, saying why: the others go on as if it had
        not come."""
        before = self._cut.get(tenant)
        backoff = self.policy.backoff_initial_s
        if before is not None and now - before.until < self.policy.window_seconds:
            # It kept at it: doubling past the breaker's own cap, to CUT_OFF_MAX_S.
            backoff = min(before.backoff * 2, max(self.policy.backoff_max_s, CUT_OFF_MAX_S))
        self._cut[tenant] = _CutOff(now + backoff, backoff, reason)
        self._bad_evaluations = 0
        for bucket in self._buckets:
            bucket.forget(tenant)
        if self._on_cut_off is not None:
            self._on_cut_off(tenant, reason, backoff)

    def _evaluate(self, now: float) -> None:
        total, failed, p99 = self.window_stats(now)
        why = ""
        limit_ms = self.policy.latency_p99_ms
        failing = total >= self.policy.min_requests and failed / total > self.policy.failure_rate
        if total >= self.policy.min_requests:
            if failing:
                why = (
                    f"failure rate {failed / total:.0%} over {total} requests "
                    f"(limit {self.policy.failure_rate:.0%})"
                )
            elif (slow := self._too_slow()) is not None:
                if p99 is not None and p99 * 1000 > limit_ms:
                    why = f"p99 latency {p99 * 1000:.0f} ms (limit {limit_ms:.0f} ms)"
                else:  # the sample missed the slow ones (a bucket of more than SAMPLES)
                    why = f"p99 latency above {limit_ms:.0f} ms ({slow[0]} of {slow[1]} slower)"
        self._bad_evaluations = self._bad_evaluations + 1 if why else 0
        if why and self._bad_evaluations >= self.policy.consecutive_windows:
            cut = self._culprits(failing, now)
            if not cut:
                if not only_shared_went_wrong(self._buckets, self.policy, failing):
                    self._open(why)
                elif self.on_unclear is not None:  # held: batches of one tenant will tell
                    self.on_unclear(self.policy.window_seconds)
            for tenant, reason in cut:
                self._cut_tenant_off(tenant, reason, now)

    def _open(self, why: str) -> None:
        if self._state == "half_open":
            self._backoff = min(self._backoff * 2, self.policy.backoff_max_s)
        else:  # why it opened, which the probes that fail since name (not nested in turn)
            self._opened_for = why
        self._open_until = self._clock.now() + self._backoff
        self._bad_evaluations = 0
        self._buckets.clear()
        self._cut.clear()  # every tenant is refused now
        self._deaths.clear()
        self._served = self._served_before = None  # served before the model failed for all
        self._move("open", why)

    def _close(self) -> None:
        self._failed_probers.clear()
        self._backoff = self.policy.backoff_initial_s
        self._buckets.clear()
        self._move("closed", "probes succeeded")
