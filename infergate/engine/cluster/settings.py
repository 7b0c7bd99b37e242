"""The profile's [cluster] table: where the shared limits live and what a replica does
when Redis does not answer. Each key's default, bounds and meaning are declared in
infergate/settings/profile_sections.py (ClusterSection)."""

from __future__ import annotations

from dataclasses import dataclass

from infergate.settings.profile_sections import ClusterSection, FailMode

_DECLARED = ClusterSection()


@dataclass(frozen=True)
class ClusterSettings:
    redis_url: str = _DECLARED.redis_url  # empty: limits are per process
    fail_mode: FailMode = _DECLARED.fail_mode
    socket_timeout_ms: float = _DECLARED.socket_timeout_ms
    connect_timeout_ms: float = _DECLARED.connect_timeout_ms
    # A concurrency slot held by a replica that died is free again within this long.
    lease_ttl_s: float = _DECLARED.lease_ttl_s
    # The share of a limit each replica enforces without Redis is 1/N, N being the larger
    # of this and the number of replicas last seen alive in Redis.
    replicas: int = _DECLARED.replicas
    key_prefix: str = _DECLARED.key_prefix

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url)
