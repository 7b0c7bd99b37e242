"""Per-tenant admission limits on an injected clock: a token bucket for the request rate
and a counter for concurrent requests."""

from __future__ import annotations

import math

from infergate.clock import Clock

# The longest Retry-After we send: a tenant whose rate is 0 never gets a token, but a
# client told "never" (or "inf", which no header can carry) cannot even learn that an
# operator raised it.
MAX_RETRY_S = 60


def retry_seconds(wait_s: float) -> int:
    """A wait as the whole seconds Retry-After carries: at least 1, at most MAX_RETRY_S."""
    if not wait_s < MAX_RETRY_S:  # also inf and nan
        return MAX_RETRY_S
    return max(1, math.ceil(wait_s))


class TokenBucket:
    """`rate` tokens a second, holding at most `burst`; one request takes one token."""

    def __init__(self, rate: float, burst: float, clock: Clock) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock.now()

    def _refill(self) -> None:
        now = self._clock.now()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def reconfigure(self, rate: float, burst: float) -> None:
        self._refill()
        self.rate, self.burst = rate, burst
        self._tokens = min(self._tokens, burst)

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def try_take(self) -> float:
        """0.0 when a token was taken; else the seconds until one will be there."""
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        if self.rate <= 0:
            return float("inf")
        return (1.0 - self._tokens) / self.rate


class ConcurrencyLimit:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def try_enter(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1
