"""The profile's [cluster] table: where the shared limits live and what a replica does
when Redis does not answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FailMode = Literal["local", "open", "closed"]
FAIL_MODES: tuple[FailMode, ...] = ("local", "open", "closed")


@dataclass(frozen=True)
class ClusterSettings:
    redis_url: str = ""  # empty: limits are per process, as without a cluster
    # Without Redis: "local" enforces this replica's share of each limit, "open" admits,
    # "closed" refuses (503).
    fail_mode: FailMode = "local"
    # redis-py waits 5 s by default, with retries; a limit check must never cost that.
    socket_timeout_ms: float = 50.0
    connect_timeout_ms: float = 50.0
    # A concurrency slot held by a replica that died is free again within this long.
    lease_ttl_s: float = 10.0
    # The share of a limit each replica enforces without Redis is 1/N, N being the larger
    # of this and the number of replicas last seen alive in Redis.
    replicas: int = 1
    key_prefix: str = "infergate"

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url)
