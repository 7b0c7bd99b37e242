"""Which tenant a circuit breaker's bad window blames (engine/admission/breaker.py): the
window's buckets, their counts per tenant and per set of tenants that shared a batch, and
the culprit they point to, if any.

A batch that several tenants' requests shared runs as slow as its slowest rows (and
fails for all, where its requests cannot run again alone): its outcomes carry the set of
those tenants (`shared`) and count for them together, as nobody's own. Counted as each
one's own, one tenant's slow rows made every batch-mate look slow, and the window, bad for
two tenants, opened for everyone. The culprit is the tenant whose batches, left out, leave
the window within the limits (the batches that held none of its requests show how the
model does without it), trying tenants from the most bad outcomes in their batches down;
a window where every request ran in batches with one tenant's cannot tell, as a window of
one tenant's alone. Cutting a tenant off takes the outcomes of the batches that held its
requests out of the window, and those of batches that held a cut-off tenant's request,
ending afterwards, do not count. Why not blame the tenant with most rows in the batch, or
time each tenant's rows alone: the first is often the victim (the busy, fast tenant),
the second costs a run; a set per batch costs one pass over the batch (in C), one more
key per shared batch in a bucket, and nothing where a batch is one tenant's (always,
without tenants: the classic breaker).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from infergate.engine.admission.breaker import BreakerPolicy

SAMPLES = 1024  # latencies a bucket keeps for the p99 it shows (the verdict counts all)
# Sets of tenants a bucket counts the batches of apart; the batches of further sets count
# together, as anybody's (`ANYBODY`): many tenants mixing in batches could make every
# batch a set of its own, and the window's cost would grow with the traffic.
SHARED_SETS = 128


@dataclass(slots=True)
class Bucket:
    start: float
    ok: int = 0
    failed: int = 0
    measured: int = 0  # latencies recorded
    slow: int = 0  # of them, above the limit in force when recorded
    latencies: list[float] = field(default_factory=list)  # a uniform sample of SAMPLES
    weight: float = 0.0  # the reservoir's state, once full (`measure`)
    next_kept: int = 0
    # Per tenant (of the outcomes that named one), or per frozenset of the tenants of a
    # batch several shared (its outcomes, theirs together): [ok, failed, measured, slow].
    tenants: dict[Hashable, list[int]] | None = None
    sets: int = 0  # of its keys, sets of tenants (at most SHARED_SETS)

    def count(
        self, key: Hashable, is_set: bool, count: int, ok: bool, measured: bool, slow: bool
    ) -> None:
        """`count` outcomes of `key` (a tenant, or when `is_set` the tenants of a batch
        they shared) in the counts by tenant: successes or failures, their latencies
        measured or not, above the limit or not."""
        per = self.tenants
        if per is None:
            per = self.tenants = {}
        counts = per.get(key)
        if counts is None:
            if is_set:
                if self.sets < SHARED_SETS:
                    self.sets += 1
                else:
                    key = ANYBODY
                    counts = per.get(key)
            if counts is None:
                counts = per[key] = [0, 0, 0, 0]
        counts[0 if ok else 1] += count
        if measured:
            counts[2] += count
            if slow:
                counts[3] += count

    def measure(self, latency_s: float, count: int, slow: bool, rng: random.Random) -> None:
        """`count` latencies of `latency_s` (`slow`: above the limit), each a step of the
        reservoir that keeps a uniform sample of SAMPLES (Li's algorithm L: every latency
        of the bucket is kept with the same chance, and only the kept ones draw random
        numbers); skipped at once where none of them would be kept."""
        first = self.measured + 1
        self.measured += count
        if slow:
            self.slow += count
        if first > SAMPLES and not (first <= self.next_kept <= self.measured):
            return  # the usual case under load: none of them is kept
        for at in range(first, self.measured + 1):
            if at <= SAMPLES:
                self.latencies.append(latency_s)
                if at == SAMPLES:
                    self.weight = math.exp(math.log(_uniform(rng)) / SAMPLES)
                    self.next_kept = SAMPLES + _skip(rng, self.weight)
            elif at == self.next_kept:
                self.latencies[int(rng.random() * SAMPLES)] = latency_s
                self.weight *= math.exp(math.log(_uniform(rng)) / SAMPLES)
                self.next_kept += _skip(rng, self.weight)

    def forget(self, tenant: Hashable) -> None:
        """Take `tenant`'s outcomes out of the counts, and those of the batches that held
        its requests (their latencies stay in the sample)."""
        if self.tenants is None:
            return
        for key in [k for k in self.tenants if k == tenant or holds(k, tenant)]:
            counts = self.tenants.pop(key)
            self.ok -= counts[0]
            self.failed -= counts[1]
            self.measured -= counts[2]
            self.slow -= counts[3]


def _uniform(rng: random.Random) -> float:
    """A random number in (0, 1)."""
    return rng.random() or 0.5


def _skip(rng: random.Random, weight: float) -> int:
    """How many latencies on the next one a full bucket keeps (algorithm L)."""
    return int(math.log(_uniform(rng)) / math.log(1.0 - weight)) + 1


@dataclass(slots=True)
class _Window:
    """A window's outcomes, [ok, failed, measured, slow], by who they are of."""

    own: dict[Hashable, list[int]]  # per tenant: its batches of its own
    shared: dict[frozenset[Hashable], list[int]]  # per set of tenants: theirs
    anybody: list[int] | None  # batches past SHARED_SETS sets in a bucket
    # Per tenant: the outcomes of every batch that held (or may have held) its requests.
    per: dict[Hashable, list[int]]
    total: list[int]  # all of them

    def sharing(self, tenant: Hashable) -> bool:
        return self.anybody is not None or any(tenant in s for s in self.shared)

    def without(self, tenants: set[Hashable]) -> list[int]:
        """The outcomes of the batches that held none of `tenants`' requests."""
        rest = list(self.total)
        held = [c for t, c in self.own.items() if t in tenants]
        held += [c for s, c in self.shared.items() if not tenants.isdisjoint(s)]
        if self.anybody is not None:
            held.append(self.anybody)
        for counts in held:
            for i, n in enumerate(counts):
                rest[i] -= n
        return rest


def _window(buckets: Iterable[Bucket]) -> _Window:
    own: dict[Hashable, list[int]] = {}
    shared: dict[frozenset[Hashable], list[int]] = {}
    total = [0, 0, 0, 0]
    for bucket in buckets:
        _add(total, [bucket.ok, bucket.failed, bucket.measured, bucket.slow])
        for key, counts in (bucket.tenants or {}).items():
            if isinstance(key, frozenset):
                add_counts(shared, key, counts)
            else:
                add_counts(own, key, counts)
    anybody = own.pop(ANYBODY, None)
    per = {tenant: list(counts) for tenant, counts in own.items()}
    for tenants, counts in shared.items():
        for tenant in tenants:
            if tenant is not None:  # (a request naming no tenant is nobody to cut off)
                add_counts(per, tenant, counts)
    if anybody is not None:
        for tenant in per:
            add_counts(per, tenant, anybody)
    return _Window(own, shared, anybody, per, total)


def culprits(
    buckets: Iterable[Bucket],
    policy: BreakerPolicy,
    failures: bool,
    served_another: Callable[[Hashable], bool],
    others_cut: bool = False,
) -> list[tuple[Hashable, str]]:
    """The tenants whose requests alone make the window bad (`failures`: by its failure
    rate, else by its p99), each with why it is cut off; none when the breaker is to open
    for everyone. One when one is enough (`_culprit`); else the fewest, each beyond the
    limits itself, whose batches, left out, leave at least `min_requests` of the others'
    within them: one sender with two tenants' keys, both failing beside a victim served
    well, opened it for everyone. `others_cut`: a tenant is cut off already, and only such
    evidence cuts off another. A model failing for every tenant leaves nobody within the
    limits, and opens."""
    window = _window(buckets)
    one = _culprit(window, policy, failures, served_another, others_cut)
    if one is not None:
        return [one]
    bad = [
        t
        for t in _worst_first(window, failures)
        if not within(window.per[t], failures, policy)
        and not _runs_well_alone(window, t, failures, policy)
    ]
    for n in range(2, len(bad) + 1):
        if _shown_well(window.without(set(bad[:n])), failures, policy):
            chosen = bad[:n]
            for tenant in reversed(bad[:n]):  # the least bad first: one not needed stays
                fewer = [t for t in chosen if t != tenant]
                if len(fewer) > 1 and _shown_well(window.without(set(fewer)), failures, policy):
                    chosen = fewer
            what = "failed" if failures else "ran above the latency limit"
            why = (
                f"its requests {what} in the window, as did {len(chosen) - 1} other "
                "tenant(s)', while the others' did not"
            )
            return [(t, why) for t in chosen]
    return []


def only_shared_went_wrong(
    buckets: Iterable[Bucket], policy: BreakerPolicy, failures: bool
) -> bool:
    """Whether the window went wrong only in batches that tenants shared, each tenant's
    own batches within the limits (at least `min_requests` of them together): the model
    serves each tenant well alone, and a batch-mate's rows made the shared batches bad,
    with nothing yet to tell which tenant's (`culprits` found none). Opening then refused
    everyone for a model that works: the breaker holds, and its version batches each
    tenant apart for a window (Breaker.on_unclear), after which the window holds batches
    of one tenant each, and tells. Never without shared batches."""
    window = _window(buckets)
    if not window.shared and window.anybody is None:
        return False
    own = [0, 0, 0, 0]
    for counts in window.own.values():
        if not within(counts, failures, policy):
            return False
        _add(own, counts)
    return _shown_well(own, failures, policy)


def served_well_without(buckets: Iterable[Bucket], policy: BreakerPolicy, tenant: Hashable) -> bool:
    """Whether the window, without the batches that held `tenant`'s requests, shows the
    model works: at least `min_requests` others' requests, within the failure rate."""
    return _shown_well(_window(buckets).without({tenant}), True, policy)


def _worst_first(window: _Window, failures: bool) -> list[Hashable]:
    """The window's tenants, most failures (or slow latencies) in their batches first."""
    return sorted(window.per, key=lambda t: window.per[t][1 if failures else 3], reverse=True)


def _shown_well(rest: list[int], failures: bool, policy: BreakerPolicy) -> bool:
    """Whether outcomes ([ok, failed, measured, slow]) show the model works: at least
    `min_requests` of them (measured ones, for the p99), within the limits."""
    enough = (rest[0] + rest[1] if failures else rest[2]) >= policy.min_requests
    return enough and within(rest, failures, policy)


def _runs_well_alone(
    window: _Window, tenant: Hashable, failures: bool, policy: BreakerPolicy
) -> bool:
    """Its requests run well in batches of their own: the batches it shared went wrong by
    another's rows (a busy tenant whose queue another's slow requests join would be cut
    off in its place, then the breaker opened for everyone once the joiner went on
    alone)."""
    alone = window.own.get(tenant)
    return window.sharing(tenant) and alone is not None and within(alone, failures, policy)


def _culprit(
    window: _Window,
    policy: BreakerPolicy,
    failures: bool,
    served_another: Callable[[Hashable], bool],
    others_cut: bool,
) -> tuple[Hashable, str] | None:
    """The one tenant whose requests alone make the window bad, and why it is cut off;
    None when no one is. A tenant is the culprit when other requests came in the window
    and, without the batches that held its requests, are within the limits; or when no
    other request came in it and the model served another tenant well since the breaker
    last opened (`served_another`); with `others_cut`, only the first, and on the evidence
    of at least `min_requests` others'. Never when the outcomes named no tenant. Candidates
    go from the most failures (or slow latencies) in their batches down: a batch several
    tenants shared counts for each of them, and the first whose batches the rest can do
    without is the one that made them fail or run slow."""
    per = window.per
    ok, failed, measured, slow = window.total
    limit_ms = policy.latency_p99_ms
    for worst in _worst_first(window, failures):
        mine = per[worst]
        count = mine[0] + mine[1]
        sharing = window.sharing(worst)
        if _runs_well_alone(window, worst, failures, policy):
            continue
        if not failures:
            what = f"the p99 latency of its requests is above {limit_ms:.0f} ms"
        elif sharing:
            what = f"{mine[1]} of the {count} requests of its batches in the window failed"
        else:
            what = f"{mine[1]} of its {count} requests in the window failed"
        if others_cut:  # one more, only on the others' evidence (`culprits`)
            if not _shown_well(window.without({worst}), failures, policy):
                continue
            return worst, f"{what}, while other tenants' requests did not"
        if count == ok + failed:
            # Its requests, and any in batches with them, alone came in the window: by
            # them it cannot tell the tenant from the model. Unless the window is its
            # own requests' alone and the model has served another tenant well since
            # it last opened (without that, perhaps nobody else uses it), it opens.
            if sharing or not served_another(worst):
                continue
            return worst, (
                f"{what}; no other tenant's requests came in the window, and another "
                "tenant's were served well before"
            )
        if failures:
            if (failed - mine[1]) / (ok + failed - count) > policy.failure_rate:
                continue
        else:
            rest = measured - mine[2]
            if not rest or p99_above(slow - mine[3], rest):
                continue
        return worst, f"{what}, while other tenants' requests did not"
    return None


def within(counts: list[int], failures: bool, policy: BreakerPolicy) -> bool:
    """Whether outcomes ([ok, failed, measured, slow]) are measured and within the
    limits the window is judged by (`failures`: its failure rate, else its p99)."""
    if failures:
        total = counts[0] + counts[1]
        return total > 0 and counts[1] / total <= policy.failure_rate
    return counts[2] > 0 and not p99_above(counts[3], counts[2])


class _Anybody:
    """The key of the outcomes of batches that several tenants shared, past SHARED_SETS
    sets in a bucket: they may have held any tenant's requests."""

    def __repr__(self) -> str:
        return "<anybody>"


ANYBODY: Hashable = _Anybody()


def holds(key: Hashable, tenant: Hashable) -> bool:
    """Whether a bucket's key is of batches several tenants shared that held (or may have
    held) `tenant`'s requests."""
    return key is ANYBODY or (isinstance(key, frozenset) and tenant in key)


K = TypeVar("K", bound=Hashable)


def add_counts(into: dict[K, list[int]], key: K, counts: list[int]) -> None:
    _add(into.setdefault(key, [0, 0, 0, 0]), counts)


def _add(total: list[int], counts: list[int]) -> None:
    for i, n in enumerate(counts):
        total[i] += n


def p99_above(slow: int, measured: int) -> bool:
    """Whether the p99 of `measured` latencies is above the limit, `slow` of them being
    above it: sorted, the latency at the p99's place is above the limit exactly when at
    least that many from the top are."""
    return measured > 0 and slow >= measured - min(measured - 1, int(0.99 * measured))


def p99(ordered: list[float]) -> float | None:
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None
