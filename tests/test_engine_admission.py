"""Tenant admission on an injected clock: rejections carry a reason code, and their
Retry-After is whole seconds that the message repeats, finite even for a rate of 0."""

from __future__ import annotations

import re

import pytest

from infergate.clock import FakeClock
from infergate.engine.admission.limits import MAX_RETRY_S, retry_seconds
from infergate.engine.admission.tenants import Tenant, Tenants
from infergate.errors import RateLimited


def refused(tenants: Tenants, name: str) -> RateLimited:
    with pytest.raises(RateLimited) as caught:
        tenants.admit(tenants.get(name), "m")
    return caught.value


def test_a_rate_of_zero_is_a_finite_retry_after_that_the_message_repeats() -> None:
    clock = FakeClock()
    tenants = Tenants([Tenant("frozen", rps=0, burst=1)], (), False, clock)
    tenants.admit(tenants.get("frozen"), "m")  # its one token
    error = refused(tenants, "frozen")
    assert error.retry_after_s == MAX_RETRY_S
    assert error.reason == "rate"
    clock.advance(3600)
    assert refused(tenants, "frozen").retry_after_s == MAX_RETRY_S  # still never refills


def test_a_slow_rate_says_the_same_whole_seconds_in_text_and_header() -> None:
    tenants = Tenants([Tenant("slow", rps=0.4, burst=1)], (), False, FakeClock())
    tenants.admit(tenants.get("slow"), "m")
    error = refused(tenants, "slow")
    assert error.retry_after_s == 3  # 2.5 s to the next token, rounded up
    assert re.search(r"retry in 3 s\b", str(error))


def test_the_reason_code_comes_from_the_exception_not_its_text() -> None:
    tenants = Tenants([Tenant("pirate", max_concurrency=1)], (), False, FakeClock())
    tenants.admit(tenants.get("pirate"), "m")
    error = refused(tenants, "pirate")
    assert "rate" in str(error)  # the tenant's name says "rate"...
    assert error.reason == "concurrency"  # ...but the code says what happened


@pytest.mark.parametrize(
    ("wait", "seconds"),
    [(0.001, 1), (1.0, 1), (1.2, 2), (59.5, 60), (1e9, 60), (float("inf"), 60)],
)
def test_retry_seconds(wait: float, seconds: int) -> None:
    assert retry_seconds(wait) == seconds
