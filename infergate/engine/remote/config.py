"""model.toml's [remote] table, as the engine holds it: where a remote model lives and how
it is reached.

    runtime = "remote"
    [remote]
    endpoints = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    model = "resnet"          # the name on the remote servers (default: this folder's)
    version = 3               # optional: the remote version (default: the remote's own)

Every other key has a default (Envoy's, where Envoy has one). Each key's type, bounds and
meaning are declared in infergate/settings/model_sections.py (RemoteSection), which takes
its defaults from this record; engine/repository/modelconfig.py reads the table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteConfig:
    endpoints: tuple[str, ...]
    model: str | None = None  # None: the local model's name
    version: str | None = None  # None: the remote server's default version
    # connection pool, per endpoint
    max_connections: int = 64
    max_keepalive: int = 16
    connect_timeout_s: float = 1.0
    max_answer_mb: int = 256  # an upstream's infer answer past this is a 502, unread
    # retries: connection failures and 503s without a body, on another endpoint
    retries: int = 1  # Envoy's num_retries
    retry_budget_percent: float = 20.0  # of requests in flight (Envoy's retry_budget)
    min_retry_concurrency: int = 3
    # active health checks on /v2/health/ready
    health_interval_s: float = 5.0
    health_timeout_s: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    # outlier detection (Envoy's names and defaults)
    consecutive_5xx: int = 5
    interval_s: float = 10.0
    base_ejection_time_s: float = 30.0
    max_ejection_time_s: float = 300.0
    max_ejection_percent: float = 10.0
