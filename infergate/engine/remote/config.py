"""model.toml's [remote] table: where a remote model lives and how it is reached.

    runtime = "remote"
    [remote]
    endpoints = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    model = "resnet"          # the name on the remote servers (default: this folder's)
    version = 3               # optional: the remote version (default: the remote's own)

Every other key has a default (Envoy's, where Envoy has one).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from infergate.errors import ConfigError
from infergate.settings.table import Table


@dataclass(frozen=True)
class RemoteConfig:
    endpoints: tuple[str, ...]
    model: str | None = None  # None: the local model's name
    version: str | None = None  # None: the remote server's default version
    # connection pool, per endpoint
    max_connections: int = 64
    max_keepalive: int = 16
    connect_timeout_s: float = 1.0
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


def _endpoint(table: Table, raw: object) -> str:
    text = raw.strip().rstrip("/") if isinstance(raw, str) else ""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise ConfigError(
            f"{table.where('endpoints')}: {raw!r} is not a V2 base URL. Hint: write it as "
            '"http://host:port" (the part before /v2)'
        )
    return text


def parse_remote(table: Table) -> RemoteConfig:
    raw = table.array("endpoints", None)
    if not raw:
        raise ConfigError(
            f'{table.where("endpoints")}: runtime = "remote" needs at least one endpoint. '
            'Hint: [remote] endpoints = ["http://host:8000"]'
        )
    endpoints = tuple(_endpoint(table, e) for e in raw)
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"{table.where('endpoints')}: an endpoint is listed twice")
    d = RemoteConfig(endpoints)
    version = table.integer("version", None, minimum=1)
    config = RemoteConfig(
        endpoints=endpoints,
        model=table.string("model", None),
        version=None if version is None else str(version),
        max_connections=table.integer("max_connections", d.max_connections, minimum=1),
        max_keepalive=table.integer("max_keepalive", d.max_keepalive, minimum=0),
        connect_timeout_s=table.number("connect_timeout_ms", 1000.0, minimum=1) / 1000.0,
        retries=table.integer("retries", d.retries, minimum=0),
        retry_budget_percent=table.number("retry_budget_percent", 20.0, minimum=0),
        min_retry_concurrency=table.integer(
            "min_retry_concurrency", d.min_retry_concurrency, minimum=0
        ),
        health_interval_s=table.number("health_interval_s", d.health_interval_s, minimum=0.01),
        health_timeout_s=table.number("health_timeout_s", d.health_timeout_s, minimum=0.001),
        unhealthy_threshold=table.integer("unhealthy_threshold", d.unhealthy_threshold, minimum=1),
        healthy_threshold=table.integer("healthy_threshold", d.healthy_threshold, minimum=1),
        consecutive_5xx=table.integer("consecutive_5xx", d.consecutive_5xx, minimum=1),
        interval_s=table.number("interval_s", d.interval_s, minimum=0.001),
        base_ejection_time_s=table.number(
            "base_ejection_time_s", d.base_ejection_time_s, minimum=0
        ),
        max_ejection_time_s=table.number("max_ejection_time_s", d.max_ejection_time_s, minimum=0),
        max_ejection_percent=table.number(
            "max_ejection_percent", d.max_ejection_percent, minimum=0
        ),
    )
    if config.max_ejection_percent > 100:
        raise ConfigError(f"{table.where('max_ejection_percent')}: expected 0 to 100")
    table.reject_unknown()
    return config


def remote_config(table: Table, runtime: str | None) -> RemoteConfig | None:
    """[remote] for a remote model; a [remote] on any other model is a mistake."""
    if runtime == "remote":
        return parse_remote(table)
    if table.names():
        raise ConfigError(
            f'{table.where("")}: a [remote] table needs runtime = "remote" at the top of model.toml'
        )
    return None
