"""The breaker's rules for batches several tenants shared, in-process on an injected
clock: such a batch counts for its tenants together, the tenant whose batches, left out,
leave the window within the limits is cut off, and where only shared batches went wrong,
the breaker holds while its version batches each tenant apart. tests/test_breaker_tenants.py
holds the rules for each tenant's own requests."""

from __future__ import annotations

from infergate.clock import FakeClock
from infergate.engine.admission.breaker import Breaker
from infergate.engine.admission.breaker_blame import SHARED_SETS
from tests.breaker_policy import POLICY, state


def batch(breaker: Breaker, latency_s: float | None, *tenants: str, ok: bool = True) -> None:
    """One batch of a request of each of `tenants` (several: a batch they shared, each
    request as slow, or failing, as the batch), each let through and recorded."""
    shared = frozenset(tenants) if len(set(tenants)) > 1 else None
    for tenant in tenants:
        if breaker.allow(tenant) == "normal":
            breaker.record("normal", ok, latency_s, tenant, shared)


def test_a_tenant_whose_rows_slow_the_batches_it_shares_is_cut_off_not_its_batch_mates() -> None:
    """B's rows make every batch they are in slow, A's alone run fast: the requests of A
    batched with B's are as slow as B's. Before, those counted as A's own, A looked slow
    too, and the breaker opened for everyone; the batches without B show the model does
    well without it, so B alone is cut off. So too where B never runs alone."""
    for b_alone in (True, False):
        clock = FakeClock()
        breaker = Breaker(POLICY, clock)
        for _ in range(3):
            batch(breaker, 0.01, "alice")
            batch(breaker, 0.5, "alice", "bob", "alice")
            if b_alone:
                batch(breaker, 0.5, "bob")
            clock.advance(0.1)
        assert state(breaker) == "closed", breaker.reason
        assert breaker.cut_off("bob") == (
            "the p99 latency of its requests is above 100 ms, while other tenants' requests did not"
        )
        assert breaker.allow("alice") == "normal"
        for _ in range(12):  # A goes on, alone now: the batches B shared were taken out
            batch(breaker, 0.01, "alice")
            clock.advance(0.1)
        assert state(breaker) == "closed", breaker.reason


def test_a_busy_tenant_whose_batches_another_joins_is_not_cut_off_in_its_place() -> None:
    """Bob sends only while Alice's requests queue, so his slow rows always ride in her
    batches; Alice's batches of her own and Carol's run fast. Before, Alice (tried first:
    as many slow outcomes as Bob, and batches of her own) was cut off, since the batches
    without hers (Carol's) were fine; Bob went on alone, and his next window opened the
    breaker for everyone ("while another tenant is cut off"). A tenant whose own batches
    are within the limits is not the one: Bob is cut off, Carol and Alice are served."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        batch(breaker, 0.01, "alice")
        batch(breaker, 0.01, "carol")
        batch(breaker, 0.5, "alice", "bob")
        clock.advance(0.1)
    assert breaker.cut_off("alice") is None
    assert breaker.cut_off("bob") is not None
    for _ in range(12):  # Bob's rows now run alone, and slow; the others go on
        batch(breaker, 0.01, "carol")
        batch(breaker, 0.01, "alice")
        if breaker.allow("bob") == "normal":
            batch(breaker, 0.5, "bob")
        clock.advance(0.1)
    assert state(breaker) == "closed", breaker.reason
    assert breaker.allow("carol") == breaker.allow("alice") == "normal"


def test_slow_rows_hidden_in_shared_batches_hold_it_until_batches_apart_tell() -> None:
    """Mallory's slow rows ride in the victim's batches, and her many fast requests keep
    the p99 of her own batches within the limit: each tenant ran well alone, nobody was
    to blame, and the breaker opened for everyone. It holds (each tenant alone is served
    well: opening would refuse everyone for a model that works) and its version batches
    each tenant apart for a window; then her slow rows slow her own batches, and she alone
    is cut off. Not the victim, though one of its own batches ran slow (blaming the tenant
    whose own batches went wrong more often, tried first, could cut the victim off)."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    unclear: list[float] = []  # its version keeps the tenants' batches apart meanwhile
    breaker.on_unclear = unclear.append
    for round in range(3):
        for _ in range(110):
            batch(breaker, 0.01, "mallory")
        for _ in range(110):
            batch(breaker, 0.01, "victim")
        if round == 0:
            batch(breaker, 0.5, "victim")  # 1 of its 331 own: within the p99
        batch(breaker, 0.5, "victim", "mallory")
        batch(breaker, 0.5, "victim", "mallory")
        clock.advance(0.1)
    assert state(breaker) == "closed", breaker.reason
    assert breaker.cut_off("mallory") is None
    assert breaker.cut_off("victim") is None
    assert set(unclear) == {POLICY.window_seconds}
    for _ in range(10):  # apart: her slow rows in batches of her own
        for _ in range(20):
            batch(breaker, 0.01, "mallory")
            batch(breaker, 0.01, "victim")
        batch(breaker, 0.5, "mallory")
        clock.advance(0.1)
    assert state(breaker) == "closed", breaker.reason
    assert "the p99 latency of its requests" in str(breaker.cut_off("mallory"))
    assert breaker.allow("victim") == "normal"


def test_a_model_slow_for_every_tenant_opens_whoever_shares_its_batches() -> None:
    """Shared batches are nobody's alone: where the batches of each tenant alone are slow
    too, or every batch held one tenant's requests with the others' (nothing to tell the
    tenant from the model by), the breaker opens for everyone, as before."""
    clock = FakeClock()
    alone_too = Breaker(POLICY, clock)
    for _ in range(3):
        batch(alone_too, 0.5, "alice")
        batch(alone_too, 0.5, "alice", "bob")
        batch(alone_too, 0.5, "bob")
        clock.advance(0.1)
    assert state(alone_too) == "open"
    always_shared = Breaker(POLICY, clock)
    batch(always_shared, 0.01, "alice")  # A served well before: no help, B never ran alone
    clock.advance(POLICY.window_seconds)
    for _ in range(3):
        batch(always_shared, 0.5, "alice", "bob")
        batch(always_shared, 0.5, "bob", "alice", "carol")
        clock.advance(0.1)
    assert state(always_shared) == "open"


def test_a_tenant_whose_requests_fail_the_batches_it_shares_is_cut_off_alone() -> None:
    """A batch that failed for all its requests (one that could not run again alone, as
    a sequence's): B's, shared with A, and B's alone fail, A's alone succeed. B alone is
    cut off, and its reason counts the requests of its batches."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        batch(breaker, 0.01, "alice")
        batch(breaker, 0.01, "alice")
        batch(breaker, None, "alice", "bob", ok=False)
        batch(breaker, None, "bob", ok=False)
        clock.advance(0.1)
    assert state(breaker) == "closed", breaker.reason
    assert breaker.cut_off("bob") == (
        "3 of the 3 requests of its batches in the window failed, while other tenants' "
        "requests did not"
    )
    assert breaker.cut_off("alice") is None


def test_many_tenants_sharing_batches_keep_a_bucket_s_counts_bounded() -> None:
    """300 tenants each share a slow batch with B, and run fast alone: a bucket counts at
    most SHARED_SETS sets of tenants, the batches of further sets together, as anybody's
    (every batch a set of its own would make the window grow with the traffic). B is still
    the one cut off, and with it goes what may have held its requests."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for i in range(300):
        batch(breaker, 0.01, f"t{i}")
        batch(breaker, 0.5, f"t{i}", "bob")
    for bucket in breaker._buckets:
        assert sum(isinstance(k, frozenset) for k in bucket.tenants or {}) == SHARED_SETS
    clock.advance(0.1)
    batch(breaker, 0.01, "alice")  # the next bucket: the window is judged
    assert state(breaker) == "closed", breaker.reason
    assert breaker.cut_off("bob") is not None
    assert breaker.window_stats()[:2] == (301, 0)  # B's batches (and anybody's) are out
    assert all(
        key != "bob" and "bob" not in str(key) for b in breaker._buckets for key in b.tenants or {}
    )


def test_batches_that_held_a_cut_off_tenant_s_requests_do_not_count_for_the_others() -> None:
    """B is cut off: the outcomes of the batches A's requests shared with B's, before it
    (in the window) and after it (in flight when it was cut off, or running while it
    was), count neither as A's nor as the model's, slow or failing, with a third tenant's
    requests in them too. Before, the next evaluation opened it for everyone."""
    for late_ok, late_latency in ((True, 0.5), (False, None)):  # slow, then failing
        clock = FakeClock()
        breaker = Breaker(POLICY, clock)
        both, three = frozenset({"alice", "bob"}), frozenset({"alice", "bob", "carol"})
        in_flight = [
            (breaker.allow(t), t, shared) for t in ("alice", "bob") for shared in (both, three)
        ]
        in_flight += [(breaker.allow("carol"), "carol", three)]
        for _ in range(3):
            batch(breaker, 0.01, "alice")
            batch(breaker, 0.01, "carol")
            batch(breaker, 0.01, "alice", "bob")  # shared, and fine
            for _ in range(3):
                batch(breaker, late_latency, "bob", ok=late_ok)
            clock.advance(0.1)
        assert breaker.cut_off("bob") is not None
        batch(breaker, 0.5, "alice", "bob")  # B refused: A's alone, and fast
        for admission, tenant, shared in in_flight:  # they end now, among A's successes
            breaker.record(admission, late_ok, late_latency, tenant, shared)
            batch(breaker, 0.01, "alice")
            clock.advance(0.1)
        assert state(breaker) == "closed", breaker.reason
        assert breaker.window_stats()[1] == 0
        assert breaker.allow("alice") == breaker.allow("carol") == "normal"
