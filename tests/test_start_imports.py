"""What `infergate serve` and the CLI import is what they use: every module imported costs
CPU on every start (the suite starts about fifty gateways and many CLI processes), so a
gateway without [cluster] never imports redis, and a command imports its own module only.
Python writes each import to stderr (PYTHONPROFILEIMPORTTIME), here the server's log."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import write_profile
from tests.server import ServerProcess


def imported(log: str) -> set[str]:
    """The modules a -X importtime log names."""
    return {line.rsplit("|", 1)[-1].strip() for line in log.splitlines() if "import time:" in line}


def test_a_gateway_without_a_cluster_never_imports_redis(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    server = ServerProcess(tmp_path / "models", write_profile(tmp_path), tmp_path / "log", env)
    server.start()
    try:
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    finally:
        server.stop()
    modules = imported(server.log.read_text())
    assert "infergate.engine.engine" in modules  # the log does list the imports
    assert not {m for m in modules if m == "redis" or m.startswith("redis.")}
    assert "infergate.engine.cluster.redis_limits" not in modules
