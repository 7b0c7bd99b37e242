"""What a replica enforces when Redis does not answer (fail_mode "local"): its share of
each tenant's limits, 1/N of the rate, the burst and the slots for N replicas."""

from __future__ import annotations

import math
from dataclasses import dataclass

from infergate.clock import Clock
from infergate.engine.admission.limits import ConcurrencyLimit, TokenBucket
from infergate.engine.admission.tenants import NO_CONCURRENCY_LIMIT, Tenant


@dataclass
class Share:
    bucket: TokenBucket
    concurrency: ConcurrencyLimit


def share_of(tenant: Tenant, replicas: int) -> tuple[float, float, int]:
    """rps, burst and max_concurrency of one replica among `replicas`."""
    n = max(1, replicas)
    rps = tenant.rps / n
    burst = max(1.0, tenant.burst / n) if math.isfinite(tenant.burst) else tenant.burst
    slots = tenant.max_concurrency
    if slots != NO_CONCURRENCY_LIMIT:
        slots = max(1, slots // n)
    return rps, burst, slots


class LocalShares:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._shares: dict[str, Share] = {}

    def get(self, tenant: Tenant, replicas: int) -> Share:
        """The tenant's share, kept across calls (its bucket keeps its tokens) and brought
        up to date with its limits and the number of replicas."""
        rps, burst, slots = share_of(tenant, replicas)
        share = self._shares.get(tenant.name)
        if share is None:
            share = self._shares[tenant.name] = Share(
                TokenBucket(rps, burst, self._clock), ConcurrencyLimit(slots)
            )
        elif (share.bucket.rate, share.bucket.burst) != (rps, burst):
            share.bucket.reconfigure(rps, burst)
        share.concurrency.limit = slots
        return share
