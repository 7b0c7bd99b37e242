"""The breaker and bucket state machines on an injected clock: every transition, the
Retry-After values, backoff doubling and its cap. No sleeps."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from infergate.clock import FakeClock
from infergate.engine.admission.breaker import Breaker, BreakerPolicy
from infergate.engine.admission.breaker_blame import SAMPLES
from infergate.engine.admission.limits import ConcurrencyLimit, TokenBucket
from infergate.engine.remote.passthrough import forward_admitted
from infergate.engine.scheduling.classes import ClassTable

POLICY = BreakerPolicy(
    window_seconds=10,
    failure_rate=0.5,
    latency_p99_ms=100,
    consecutive_windows=2,
    min_requests=4,
    backoff_initial_s=2,
    backoff_max_s=5,
    probes=2,
    buckets=10,
)


def feed(
    breaker: Breaker, clock: FakeClock, ok: bool, latency: float | None = 0.01, n: int = 4
) -> None:
    for _ in range(n):
        assert breaker.allow() == "normal"
        breaker.record("normal", ok, latency)
    clock.advance(1.0)  # one bucket; an evaluation happens at each bucket boundary


def trip(breaker: Breaker, clock: FakeClock) -> None:
    feed(breaker, clock, ok=False)
    feed(breaker, clock, ok=False)
    assert breaker.allow() == "refused"


def test_failure_rate_opens_after_consecutive_windows() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    feed(breaker, clock, ok=False)
    assert breaker.allow() == "normal"  # one bad evaluation is not enough
    breaker.record("normal", False, 0.01)
    feed(breaker, clock, ok=False)
    assert breaker.state == "open"
    assert "failure rate" in breaker.reason
    assert breaker.allow() == "refused"
    assert breaker.retry_after() == pytest.approx(2.0)


def test_the_window_p99_is_none_until_a_latency_is_measured() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    assert breaker.window_stats() == (0, 0, None)
    for _ in range(2):  # failures whose latency was not measured (a worker died)
        feed(breaker, clock, ok=False, latency=None)
    assert breaker.window_stats() == (8, 8, None)
    assert breaker.state == "open"  # the failure rate still counts
    breaker.reset()
    feed(breaker, clock, ok=True, latency=0.02)
    assert breaker.window_stats() == (4, 0, 0.02)


def test_a_good_window_between_bad_ones_keeps_it_closed() -> None:
    clock = FakeClock()
    breaker = Breaker(
        BreakerPolicy(
            window_seconds=2, failure_rate=0.5, min_requests=4, consecutive_windows=2, buckets=2
        ),
        clock,
    )
    feed(breaker, clock, ok=False)
    feed(breaker, clock, ok=True, n=12)  # the window now holds 4 failures in 16
    feed(breaker, clock, ok=False)
    assert breaker.state == "closed"


def test_too_few_requests_never_open_it() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):  # 3 failures in the window: under min_requests = 4
        feed(breaker, clock, ok=False, n=1)
    assert breaker.state == "closed"
    clock.advance(10)  # they leave the window; a fourth alone is still too few
    feed(breaker, clock, ok=False, n=1)
    assert breaker.state == "closed"


def test_p99_latency_opens_it() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    feed(breaker, clock, ok=True, latency=0.5)
    feed(breaker, clock, ok=True, latency=0.5)
    assert breaker.state == "open"
    assert "p99 latency 500 ms (limit 100 ms)" in breaker.reason


def busy_second(breaker: Breaker, clock: FakeClock, n: int, slow: int) -> None:
    """A bucket of `n` requests (far more than a bucket's sample), `slow` of them spread
    evenly at 500 ms, the rest at 10 ms; then the bucket's evaluation."""
    every = n // slow if slow else n + 1
    for i in range(n):
        breaker.record(
            "normal", True, 0.5 if slow and i % every == 0 and i // every < slow else 0.01
        )
    clock.advance(1.0)


@pytest.mark.parametrize(("slow", "opens"), [(199, False), (200, True)])
def test_the_p99_verdict_is_exact_past_the_sample(slow: int, opens: bool) -> None:
    """20,000 requests a bucket: the p99 is above the limit when 1% of them (200) are,
    not when 199 are, as with every latency sorted, though a bucket keeps a sample."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    busy_second(breaker, clock, 20_000, slow)
    busy_second(breaker, clock, 20_000, slow)
    assert breaker.state == ("open" if opens else "closed")
    if opens:
        assert "p99 latency" in breaker.reason
        assert "(limit 100 ms)" in breaker.reason or "of 40000 slower" in breaker.reason


def test_the_window_holds_a_bounded_sample_whatever_the_traffic() -> None:
    """Every request counts, but a bucket keeps at most SAMPLES latencies (all of them
    were kept, and sorted at each evaluation: 700,000 at 12,000 requests/s), and the p99
    shown from them is close to the true one."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        for i in range(30_000):  # 0 to 99.99 ms, evenly: the true p99 is 99 ms
            breaker.record("normal", True, (i * 7919 % 30_000) / 300_000)
        clock.advance(1.0)
    total, failed, p99 = breaker.window_stats()
    assert (total, failed) == (90_000, 0)
    assert p99 is not None
    assert p99 == pytest.approx(0.099, abs=0.002)
    assert all(len(b.latencies) <= SAMPLES for b in breaker._buckets)
    assert breaker.state == "closed"  # no latency above the 100 ms limit


def test_half_open_probes_close_it_and_reset_the_backoff() -> None:
    clock = FakeClock()
    moves: list[str] = []
    breaker = Breaker(POLICY, clock, on_change=lambda state, _: moves.append(state))
    trip(breaker, clock)
    clock.advance(1.9)
    assert breaker.allow() == "refused"
    clock.advance(0.2)
    assert breaker.allow() == "probe"
    assert breaker.state == "half_open"
    assert breaker.allow() == "probe"
    assert breaker.allow() == "refused"  # only `probes` go through
    breaker.record("probe", True, 0.01)
    breaker.record("probe", True, 0.01)
    assert str(breaker.state) == "closed"  # str(): mypy keeps the narrowing from above
    assert moves == ["open", "half_open", "closed"]
    trip(breaker, clock)
    assert breaker.retry_after() == pytest.approx(2.0)  # back to the initial backoff


def test_a_probe_whose_client_left_gives_its_place_back() -> None:
    """A cancelled probe has no outcome: without its place back, a breaker whose probes'
    clients all left (they do, when the model is slow) stayed half-open refusing everyone."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    trip(breaker, clock)
    clock.advance(2.1)
    assert breaker.allow() == "probe"
    assert breaker.allow() == "probe"
    breaker.unjudged("probe")  # its client left
    breaker.unjudged("probe")  # twice: never more places than `probes`
    assert breaker.allow() == "probe"
    assert breaker.allow() == "probe"
    assert breaker.allow() == "refused"
    breaker.record("probe", True, 0.01)
    breaker.record("probe", True, 0.01)
    assert breaker.state == "closed"


async def test_a_remote_probe_whose_client_left_gives_its_place_back() -> None:
    """The same for a remote model's pass-through (engine/remote/passthrough.py), whose
    upstream call is cancelled when its client leaves."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    trip(breaker, clock)
    clock.advance(2.1)
    upstream_answers = asyncio.Event()  # never set: the client leaves first

    async def forward(*_: object) -> None:
        await upstream_answers.wait()

    served = SimpleNamespace(breaker=breaker, forward=forward, config=SimpleNamespace(timeout_s=30))
    context = SimpleNamespace(settings=SimpleNamespace(classes=ClassTable()), clock=clock)
    tenant = SimpleNamespace(tenant=SimpleNamespace(cls="batch", name="t"))
    calls = [
        asyncio.ensure_future(
            forward_admitted(context, served, b"", {}, None, None, tenant)  # type: ignore[arg-type]
        )
        for _ in range(POLICY.probes)
    ]
    await asyncio.sleep(0)
    assert breaker.allow() == "refused"  # both probes' places are taken
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert breaker.state == "half_open"
    assert breaker.allow() == "probe"


def test_a_failed_probe_reopens_with_doubled_backoff_up_to_the_cap() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    trip(breaker, clock)
    waits = []
    for _ in range(4):
        waits.append(breaker.retry_after())
        clock.advance(breaker.retry_after())
        assert breaker.allow() == "probe"
        breaker.record("probe", False, 0.01)
        assert breaker.state == "open"
    assert waits == pytest.approx([2.0, 4.0, 5.0, 5.0])


def test_operator_reset_closes_it() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    trip(breaker, clock)
    breaker.reset()
    assert breaker.state == "closed"
    assert breaker.allow() == "normal"


def test_bucket_refills_at_its_rate_and_says_when() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2, burst=3, clock=clock)
    assert [bucket.try_take() for _ in range(3)] == [0, 0, 0]
    assert bucket.try_take() == pytest.approx(0.5)  # one token in half a second
    clock.advance(0.25)
    assert bucket.try_take() == pytest.approx(0.25)
    clock.advance(0.25)
    assert bucket.try_take() == 0
    clock.advance(100)
    assert bucket.tokens == 3  # never more than the burst
    bucket.reconfigure(rate=1, burst=1)
    assert bucket.try_take() == 0
    assert bucket.try_take() == pytest.approx(1.0)


def test_concurrency_limit() -> None:
    limit = ConcurrencyLimit(2)
    assert limit.try_enter()
    assert limit.try_enter()
    assert not limit.try_enter()
    limit.leave()
    assert limit.try_enter()
