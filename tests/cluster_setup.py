"""Three (or one) `infergate serve` replicas sharing their tenants' limits through one real
redis-server, all on loopback: what the cluster tests start."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.redis_server import RedisProcess, have_redis_server
from tests.scripted_runtime import make_scripted
from tests.server import ServerProcess


def require_redis_server() -> None:
    if not have_redis_server():
        pytest.fail(
            "redis-server is not installed. Hint: ./install.sh --dev installs it "
            "(apt-get install -y redis-server as root)"
        )


@contextmanager
def running_redis(folder: Path) -> Iterator[RedisProcess]:
    """A real redis-server of its own on a loopback port, killed at the end."""
    require_redis_server()
    process = RedisProcess(folder).start()
    try:
        yield process
    finally:
        process.kill()


def cluster_profile(redis: RedisProcess, cluster: str = "", tenant: str = "") -> str:
    return (
        f'[cluster]\nredis_url = "{redis.url}"\n{cluster}\n'
        f'[tenants.default]\nclass = "batch"\n{tenant}\n'
    )


@contextmanager
def replicas(
    tmp_path: Path, profile: str, count: int, gates: Path | None = None
) -> Iterator[list[ServerProcess]]:
    """`count` replicas with the same profile serving `m`, a scripted model; when `gates`
    is given, `m` holds a call at gate N for `hold` = N, and `quick` (never held, its own
    worker) answers at once."""
    models = tmp_path / "models"
    controls = ("hold",) if gates is not None else ()
    make_scripted(models / "m" / "1" / "model.scripted", controls, gate_dir=gates)
    if gates is not None:
        make_scripted(models / "quick" / "1" / "model.scripted", ())
    servers = []
    try:
        for i in range(count):
            folder = tmp_path / f"replica{i}"
            folder.mkdir()
            (folder / "profile.toml").write_text(profile)
            servers.append(
                ServerProcess(models, folder / "profile.toml", folder / "server.log").start()
            )
        yield servers
    finally:
        for server in servers:
            # No test here looks at a replica's drain, which waits up to 30 s for a
            # request a test left held (seen in full parallel runs: 25 s of teardown).
            server.stop(grace_s=3)
