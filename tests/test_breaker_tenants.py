"""The breaker's tenant rules, in-process on an injected clock: it cuts off the one tenant
that fails it (and opens for everyone only when it cannot tell the tenant from the model),
in the closed state and among the half-open probes, and a tenant that keeps at it stays cut
off longer than the breaker's own backoff. tests/test_tenant_isolation.py holds the same
promises end to end, on one real server."""

from __future__ import annotations

import pytest

from infergate.clock import FakeClock
from infergate.engine.admission.breaker import (
    CUT_OFF_MAX_S,
    PROBE_GRACE_S,
    Breaker,
    BreakerPolicy,
)
from tests.breaker_policy import POLICY, state


def outcomes(breaker: Breaker, clock: FakeClock, **tenants: bool) -> None:
    """A request of each tenant named (True: it succeeds) that the breaker lets through,
    then one bucket later."""
    for tenant, ok in tenants.items():
        if breaker.allow(tenant) == "normal":
            breaker.record("normal", ok, 0.01, tenant)
    clock.advance(0.1)


def test_a_breaker_cuts_off_the_one_tenant_that_fails_it() -> None:
    clock = FakeClock()
    cut: list[tuple[object, float]] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, _, backoff: cut.append((t, backoff)))
    for _ in range(3):
        outcomes(breaker, clock, alice=True, bob=False)
    assert cut == [("bob", 2)]
    assert breaker.state == "closed"
    assert breaker.allow("bob") == "refused"
    assert breaker.allow("alice") == "normal"
    assert breaker.retry_after("bob") == pytest.approx(1.9)
    assert breaker.retry_after("alice") == 0
    clock.advance(2)  # over: it keeps at it, and is cut off for twice as long
    for _ in range(3):
        outcomes(breaker, clock, alice=True, bob=False)
    assert cut[-1] == ("bob", 4)
    breaker.reset()
    assert breaker.allow("bob") == "normal"


def test_a_breaker_opens_when_the_model_fails_for_two_tenants_or_the_only_one() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        outcomes(breaker, clock, alice=False, bob=False)
    assert breaker.state == "open"
    lone = Breaker(POLICY, clock)
    for _ in range(5):
        outcomes(lone, clock, bob=False)  # no one else's requests: it cannot tell
    assert lone.state == "open"


def test_a_tenant_failing_alone_is_cut_off_once_the_model_served_another() -> None:
    """No other tenant's requests in the window, but A was served well before: B alone is
    cut off, saying so. A failing too (B cut off) opens it for everyone."""
    clock = FakeClock()
    cut: list[tuple[object, str]] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, why, _: cut.append((t, why)))
    outcomes(breaker, clock, alice=True)
    clock.advance(POLICY.window_seconds)  # A's request has left the window
    for _ in range(5):
        outcomes(breaker, clock, bob=False)
    assert state(breaker) == "closed"
    [(tenant, why)] = cut
    assert tenant == "bob"
    assert why == (
        "4 of its 4 requests in the window failed; no other tenant's requests came in "
        "the window, and another tenant's were served well before"
    )
    assert breaker.allow("bob") == "refused"
    assert breaker.allow("alice") == "normal"
    for _ in range(5):
        outcomes(breaker, clock, alice=False)
    assert state(breaker) == "open"


def test_a_tenant_running_slow_alone_is_cut_off_once_the_model_served_another() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    outcomes(breaker, clock, alice=True)
    clock.advance(POLICY.window_seconds)
    for _ in range(5):
        if breaker.allow("bob") == "normal":
            breaker.record("normal", True, 0.5, "bob")  # above the 100 ms p99 limit
        clock.advance(0.1)
    assert state(breaker) == "closed"
    assert "p99 latency of its requests" in (breaker.cut_off("bob") or "")
    assert "no other tenant's requests came" in (breaker.cut_off("bob") or "")


def test_a_tenant_failing_alone_opens_it_when_no_other_was_served_well_since_it_opened() -> None:
    """A window of one tenant's requests opens it for everyone unless another tenant was
    served well since it last opened: not the tenant's own successes, not another's slow
    ones, not another's from before the model failed for all (the default tenant alone,
    where no tenants are configured, is the first case)."""
    clock = FakeClock()
    own = Breaker(POLICY, clock)
    outcomes(own, clock, bob=True)
    clock.advance(POLICY.window_seconds)
    for _ in range(5):
        outcomes(own, clock, bob=False)
    assert state(own) == "open"
    slow = Breaker(POLICY, clock)
    slow.record(slow.allow("alice"), True, 0.5, "alice")  # served, above the p99 limit
    clock.advance(POLICY.window_seconds)
    for _ in range(5):
        outcomes(slow, clock, bob=False)
    assert state(slow) == "open"
    before = Breaker(POLICY, clock)
    outcomes(before, clock, alice=True)
    for _ in range(5):
        outcomes(before, clock, alice=False, bob=False)  # the model fails for two
    assert state(before) == "open"
    clock.advance(POLICY.backoff_initial_s)
    assert before.allow("bob") == "probe"
    before.record("probe", True, 0.01, "bob")
    assert state(before) == "closed"
    for _ in range(5):
        outcomes(before, clock, bob=False)
    assert state(before) == "open"  # A's success came before the model failed for all


def test_a_tenant_whose_requests_alone_run_slow_is_cut_off() -> None:
    """B's inputs make the model slow (its p99 above the limit), A's run fast: B alone."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        for tenant, latency in (("alice", 0.01), ("bob", 0.5)):
            if breaker.allow(tenant) == "normal":
                breaker.record("normal", True, latency, tenant)
        clock.advance(0.1)
    assert breaker.state == "closed"
    assert breaker.cut_off("bob") is not None
    assert "p99 latency" in (breaker.cut_off("bob") or "")
    assert breaker.cut_off("alice") is None


def test_a_cut_off_tenant_s_answers_in_flight_do_not_open_it_for_the_others() -> None:
    """B's requests admitted before its cut-off (in flight then) end after it, failing or
    slow, while A is served: they do not count, neither as the model failing nor as a
    second tenant failing it. Before, the next evaluation opened it for everyone."""
    for late_ok, late_latency in ((False, None), (True, 0.5)):  # failing, then slow
        clock = FakeClock()
        breaker = Breaker(POLICY, clock)
        in_flight = [breaker.allow("bob") for _ in range(8)]
        assert in_flight == ["normal"] * 8
        for _ in range(3):
            if breaker.allow("alice") == "normal":
                breaker.record("normal", True, 0.01, "alice")
            if breaker.allow("bob") == "normal":
                breaker.record("normal", late_ok, late_latency or 0.01, "bob")
            clock.advance(0.1)
        assert breaker.cut_off("bob") is not None
        for admission in in_flight:  # they end now, one a bucket, among A's successes
            breaker.record(admission, late_ok, late_latency, "bob")
            outcomes(breaker, clock, alice=True)
        assert state(breaker) == "closed", breaker.reason
        assert breaker.allow("alice") == "normal"
        assert breaker.window_stats()[1] == 0  # A's alone
        clock.advance(2)  # its cut-off is over: its answers count again
        for _ in range(3):
            outcomes(breaker, clock, alice=True, bob=False)
        assert breaker.cut_off("bob") is not None  # cut off again, not opened
        assert state(breaker) == "closed"


def test_a_tenant_whose_lone_requests_end_two_workers_is_cut_off() -> None:
    """A query of death: B's requests, each running alone, end a worker twice within the
    window, once A was served well: B is cut off, without min_requests, saying why, and
    neither run gets another try (it would end a sibling). Where nobody else was served
    (the default tenant alone, no tenants configured) nobody is cut off, and a lone
    request gets its try unless its tenant ended another worker within the window."""
    clock = FakeClock()
    cut: list[tuple[object, str]] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, why, _: cut.append((t, why)))
    outcomes(breaker, clock, alice=True)
    assert breaker.worker_ended("bob", "crashed") is False
    assert not cut
    clock.advance(0.5)
    assert breaker.worker_ended("bob", "was killed for its memory") is False
    assert cut == [
        (
            "bob",
            "its requests ended 2 workers of this version within 1 s, each running alone "
            "(the last was killed for its memory)",
        )
    ]
    assert state(breaker) == "closed"
    assert breaker.allow("bob") == "refused"
    assert breaker.allow("alice") == "normal"
    assert breaker.worker_ended("bob", "crashed") is False  # one admitted before its cut-off
    assert len(cut) == 1
    # Deaths further apart than the window: none cut it off.
    apart = Breaker(POLICY, clock)
    outcomes(apart, clock, alice=True)
    apart.worker_ended("bob", "crashed")
    clock.advance(POLICY.window_seconds)
    apart.worker_ended("bob", "crashed")
    assert apart.cut_off("bob") is None
    # The default tenant alone: nobody to protect, and a first death may be chance.
    lone = Breaker(POLICY, clock)
    outcomes(lone, clock, default=True)
    assert lone.worker_ended("default", "crashed") is True
    assert lone.worker_ended("default", "crashed") is False  # it ended one already
    clock.advance(POLICY.window_seconds)
    assert lone.worker_ended("default", "crashed") is True
    assert lone.cut_off("default") is None
    assert state(lone) == "closed"
    assert lone.worker_ended(None, "crashed") is True  # an outcome naming nobody
    # A second tenant ending workers while one is cut off: the model, for everyone.
    two = Breaker(POLICY, clock)
    outcomes(two, clock, carol=True)
    for tenant in ("bob", "bob", "alice", "alice"):
        two.worker_ended(tenant, "crashed")
    assert state(two) == "open"
    assert "a second tenant's requests ended 2 workers" in two.reason


def test_a_tenant_that_keeps_at_it_stays_cut_off_longer_than_the_breaker_s_cap() -> None:
    """A query of death a second: capped at the breaker's 30 s, a tenant's cut-off kept a
    shared model restarting every 30 s at its longest restart backoff (36% of another
    tenant's requests failed). It doubles on past the breaker's cap, to CUT_OFF_MAX_S,
    well past the 60 s after which a restarted worker counts as stable."""
    clock = FakeClock()
    backoffs: list[float] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda _t, _why, s: backoffs.append(s))
    outcomes(breaker, clock, alice=True)
    for _ in range(12):
        breaker.worker_ended("bob", "crashed")
        breaker.worker_ended("bob", "crashed")
        assert breaker.cut_off("bob") is not None
        clock.advance(breaker.retry_after("bob") + 0.01)  # back as soon as it may, at it again
        outcomes(breaker, clock, alice=True)
    assert backoffs[:3] == [2, 4, 8]  # POLICY's backoff_max_s is 5: passed
    assert max(backoffs) == CUT_OFF_MAX_S
    assert state(breaker) == "closed"
    assert breaker.allow("alice") == "normal"


def test_half_open_a_tenant_whose_probe_fails_after_another_s_succeeded_is_cut_off_alone() -> None:
    """A tenant failing as fast as another succeeds kept the breaker open for both, each of
    its failed probes reopening it (the victim at 100% 503s for 45 s). Once another
    tenant's probe succeeded, a failed probe cuts off its own tenant; with none, it
    reopens the breaker, its reason not nested once more each time."""
    clock = FakeClock()
    policy = BreakerPolicy(**{**POLICY.__dict__, "probes": 2})
    breaker = Breaker(policy, clock)
    for _ in range(3):  # the model fails for both: open for everyone
        outcomes(breaker, clock, alice=False, bob=False)
    assert state(breaker) == "open"
    first = breaker.reason
    for failed in range(3):  # probes failing with none succeeded: reopened, one reason
        clock.advance(breaker.retry_after() + 0.01)
        if failed:  # bob's probe failed since it opened: the others probe first
            assert breaker.allow("bob") == "refused"
            assert breaker.retry_after("bob") == pytest.approx(PROBE_GRACE_S)
            clock.advance(PROBE_GRACE_S)
        assert breaker.allow("bob") == "probe"
        breaker.record("probe", False, 0.01, "bob")
        assert state(breaker) == "open"
        assert breaker.reason == f"a probe failed ({first})"
    clock.advance(breaker.retry_after() + 0.01)
    assert breaker.allow("alice") == "probe"
    breaker.record("probe", True, 0.01, "alice")
    clock.advance(PROBE_GRACE_S)  # (bob, whose probes failed, probes after the others)
    assert breaker.allow("bob") == "probe"
    breaker.record("probe", False, 0.01, "bob")
    assert state(breaker) == "half_open"  # bob alone is cut off
    assert breaker.allow("bob") == "refused"
    assert breaker.cut_off("bob") == "its probe failed while another tenant's succeeded"
    assert breaker.allow("alice") == "probe"  # bob's place went back to the probes
    breaker.record("probe", True, 0.01, "alice")
    assert state(breaker) == "closed"
    assert breaker.allow("alice") == "normal"
    assert breaker.allow("bob") == "refused"


def test_half_open_probes_failing_for_a_second_tenant_open_it_for_everyone() -> None:
    """The model fails for all after some probes succeeded: the first tenant whose probe
    fails is cut off alone, a second one's opens it for everyone (as in the closed state),
    not a cut-off each for as long as the model stays broken."""
    clock = FakeClock()
    policy = BreakerPolicy(**{**POLICY.__dict__, "probes": 3})
    breaker = Breaker(policy, clock)
    for _ in range(3):
        outcomes(breaker, clock, alice=False, bob=False)
    clock.advance(breaker.retry_after() + 0.01)
    for tenant in ("alice", "bob"):
        assert breaker.allow(tenant) == "probe"
        breaker.record("probe", True, 0.01, tenant)
    assert breaker.allow("carol") == "probe"
    breaker.record("probe", False, 0.01, "carol")
    assert state(breaker) == "half_open"
    assert breaker.allow("alice") == "probe"
    breaker.record("probe", False, 0.01, "alice")
    assert state(breaker) == "open"
    assert breaker.reason.startswith("a probe failed (failure rate")


def failures(breaker: Breaker, tenant: str, n: int, shared: frozenset[str] | None = None) -> None:
    """`n` failed requests of `tenant` (in batches with `shared`' requests, if named)."""
    for _ in range(n):
        if breaker.allow(tenant) == "normal":
            breaker.record("normal", False, 0.01, tenant, shared)


def test_two_tenants_failing_beside_one_served_well_are_each_cut_off() -> None:
    """One sender with two tenants' keys, both failing while a victim is served: without
    either one the window is still bad, without both it is not: both are cut off, and the
    breaker stays closed for the victim. Before, two tenants failing opened it for
    everyone (a victim served 124 of 296 requests over 60 s). One more failing while
    another is cut off is cut off too, on the victim's requests' evidence (at least
    min_requests of them); a model failing for the victim too opens for everyone."""
    clock = FakeClock()
    cut: list[tuple[object, str]] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, why, _s: cut.append((t, why)))
    for _ in range(POLICY.min_requests + 1):
        outcomes(breaker, clock, victim=True)
    failures(breaker, "mallory", 3)
    failures(breaker, "trudy", 3)
    outcomes(breaker, clock, victim=True)
    outcomes(breaker, clock, victim=True)  # (evaluated)
    why = "its requests failed in the window, as did 1 other tenant(s)', while the others' did not"
    assert cut == [("mallory", why), ("trudy", why)]
    assert state(breaker) == "closed"
    assert breaker.allow("victim") == "normal"
    assert breaker.allow("mallory") == breaker.allow("trudy") == "refused"
    clock.advance(breaker.retry_after("mallory"))  # back, one at a time
    for attacker in ("mallory", "trudy"):
        for _ in range(5):
            outcomes(breaker, clock, victim=True, **{attacker: False})
        assert cut[-1][0] == attacker
        assert breaker.cut_off("mallory") is not None
    assert len(cut) == 4
    assert state(breaker) == "closed"
    for _ in range(5):
        outcomes(breaker, clock, victim=False)
    assert state(breaker) == "open"


def test_tenants_failing_beside_too_few_others_open_it_and_an_innocent_batch_mate_stays() -> None:
    """Too few of the others' requests to tell (fewer than min_requests): the model may
    fail for all, and it opens, as before. With enough, the fewest tenants are cut off:
    carol, whose only failures came in batches shared with mallory's failing rows, is
    not, though she has more of them than trudy."""
    clock = FakeClock()
    few = Breaker(POLICY, clock)
    outcomes(few, clock, victim=True)
    failures(few, "mallory", 3)
    failures(few, "trudy", 3)
    outcomes(few, clock, victim=True)
    outcomes(few, clock, victim=True)
    assert state(few) == "open"
    cut: list[object] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, _why, _s: cut.append(t))
    for _ in range(POLICY.min_requests + 1):
        outcomes(breaker, clock, victim=True)
    failures(breaker, "mallory", 3)
    failures(breaker, "carol", 4, frozenset({"mallory", "carol"}))
    failures(breaker, "trudy", 3)
    outcomes(breaker, clock, victim=True)
    outcomes(breaker, clock, victim=True)
    assert cut == ["mallory", "trudy"]
    assert state(breaker) == "closed"
    assert breaker.allow("carol") == "normal"


def test_a_tenant_whose_probe_failed_lets_the_others_probe_first() -> None:
    """Two tenants' keys, one sender: it opens the breaker for everyone (the model fails
    for two), then times a failing request to be the first probe of each half-open
    period. Each identity whose probe failed waits PROBE_GRACE_S into the next period,
    so another tenant's requests probe, and succeed, and close it."""
    clock = FakeClock()
    policy = BreakerPolicy(**{**POLICY.__dict__, "probes": 2})
    breaker = Breaker(policy, clock)
    for _ in range(3):
        outcomes(breaker, clock, mallory=False, trudy=False)
    assert state(breaker) == "open"
    for attacker in ("mallory", "trudy"):  # each identity's first probe reopens it
        clock.advance(breaker.retry_after() + 0.001)
        assert breaker.allow(attacker) == "probe"
        breaker.record("probe", False, 0.01, attacker)
        assert state(breaker) == "open"
    clock.advance(breaker.retry_after() + 0.001)
    assert breaker.allow("mallory") == "refused"
    assert breaker.allow("trudy") == "refused"
    for _ in range(policy.probes):
        assert breaker.allow("victim") == "probe"
        breaker.record("probe", True, 0.01, "victim")
    assert state(breaker) == "closed"
    assert breaker.allow("victim") == "normal"


def test_a_second_tenant_s_query_of_death_beside_others_served_well_cuts_it_off() -> None:
    """While mallory is cut off, trudy's requests end two workers: with carol's requests
    in the window within the limits (min_requests of them), trudy alone is cut off, not the
    model for carol (two tenants' keys, one sender, through crashes). With too few of
    them, it opens for everyone, as before."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(POLICY.min_requests + 1):
        outcomes(breaker, clock, carol=True)
    failures(breaker, "mallory", 4)
    outcomes(breaker, clock, carol=True)
    outcomes(breaker, clock, carol=True)  # (evaluated)
    assert breaker.cut_off("mallory") is not None
    for _ in range(2):
        breaker.worker_ended("trudy", "crashed")
    assert state(breaker) == "closed"
    assert breaker.cut_off("trudy") is not None
    assert breaker.allow("carol") == "normal"
    few = Breaker(POLICY, clock)
    outcomes(few, clock, carol=True)
    failures(few, "mallory", 4)
    outcomes(few, clock, carol=True)
    outcomes(few, clock, carol=True)
    assert few.cut_off("mallory") is not None
    for _ in range(2):
        few.worker_ended("trudy", "crashed")
    assert state(few) == "open"
