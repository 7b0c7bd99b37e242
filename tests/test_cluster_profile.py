"""The profile's [cluster] table (issue 17): read, mistakes named, a change needs a
restart; and each replica's share of a limit for fail_mode "local"."""

from __future__ import annotations

from pathlib import Path

import pytest

from infergate.engine.admission.tenants import NO_CONCURRENCY_LIMIT, Tenant
from infergate.engine.cluster.local_share import share_of
from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.errors import ConfigError
from infergate.profile import load_profile
from infergate.profile_store import ProfileStore


def test_cluster_settings_are_read(tmp_path: Path) -> None:
    path = tmp_path / "profile.toml"
    path.write_text(
        '[cluster]\nredis_url = "redis://10.0.0.5:6379/2"\nfail_mode = "closed"\n'
        "socket_timeout_ms = 20\nlease_ttl_s = 5\nreplicas = 4\n"
    )
    cluster = load_profile(path).cluster
    assert cluster.enabled
    assert (cluster.fail_mode, cluster.socket_timeout_ms, cluster.connect_timeout_ms) == (
        "closed",
        20,
        50,
    )
    assert (cluster.lease_ttl_s, cluster.replicas) == (5, 4)
    assert not load_profile(None).cluster.enabled  # off unless a redis_url is given


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('redis_url = "10.0.0.5:6379"', 'cluster.redis_url: expected a Redis URL such as "redis'),
        ('redis_url = "redis://r"\nfail_mode = "lax"', "cluster.fail_mode"),
        ("socket_timeout_ms = 0", "cluster.socket_timeout_ms"),
        ("redis = 1", "cluster.redis"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "profile.toml"
    path.write_text(f"[cluster]\n{text}\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_profile(path)


def test_a_cluster_change_says_it_needs_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "profile.toml"
    path.write_text('[cluster]\nredis_url = "redis://a:6379/0"\n')
    engine = Engine(EngineSettings(models_dir=tmp_path), EngineContext())
    store = ProfileStore(path, load_profile(path), engine)
    path.write_text('[cluster]\nredis_url = "redis://b:6379/0"\n')
    assert store.reload()
    messages = [e.message for e in engine.context.events.recent() if e.kind.endswith("needed")]
    assert messages == [
        "[cluster] redis_url changed; it applies at the next start (infergate serve)"
    ]


def test_each_replica_enforces_its_share() -> None:
    tenant = Tenant("t", rps=30, burst=6, max_concurrency=8)
    assert share_of(tenant, 3) == (10, 2, 2)
    assert share_of(tenant, 1) == (30, 6, 8)
    assert share_of(tenant, 20) == (1.5, 1, 1)  # never less than one request or slot
    unlimited = share_of(Tenant("u"), 3)
    assert unlimited[2] == NO_CONCURRENCY_LIMIT
