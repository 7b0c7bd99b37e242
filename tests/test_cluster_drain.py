"""SIGTERM on a replica (issue 17, for Kubernetes): readiness turns 503 at once while
liveness stays 200, the requests in flight finish, and the replica's leases are released,
those of requests cut off by the end of the drain too (not left to expire)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx

from tests.cluster_setup import cluster_profile, replicas
from tests.polling import wait_until
from tests.redis_server import RedisProcess
from tests.scripted_runtime import scripted_inputs
from tests.server import ServerProcess

LEASES = "infergate:leases:default"


def _profile(redis: RedisProcess, drain_timeout_s: float) -> str:
    # A lease TTL far longer than the test: only a release explains a lease gone.
    return f"[server]\ndrain_timeout_s = {drain_timeout_s}\n" + cluster_profile(
        redis, "lease_ttl_s = 600\nsocket_timeout_ms = 500", "max_concurrency = 4"
    )


def _hold(server: ServerProcess, answers: list[int]) -> threading.Thread:
    def send() -> None:
        try:
            r = httpx.post(
                f"{server.url}/v2/models/m/infer", json=scripted_inputs(hold=1), timeout=120
            )
            answers.append(r.status_code)
        except httpx.HTTPError:
            answers.append(-1)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_sigterm_turns_readiness_off_finishes_requests_and_releases_leases(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    leases = redis_server.client()
    with replicas(tmp_path, _profile(redis_server, 60), 1, gates) as (server,):
        assert server.process is not None
        answers: list[int] = []
        thread = _hold(server, answers)
        wait_until(lambda: leases.zcard(LEASES) == 1, 60, "the held request's lease")
        server.process.send_signal(signal.SIGTERM)
        ready = wait_until(
            lambda: (
                (r := httpx.get(f"{server.url}/v2/health/ready", timeout=10)).status_code == 503
                and r
            ),
            30,
            "readiness to turn 503",
        )
        assert "shutting down" in ready.json()["error"]
        assert httpx.get(f"{server.url}/v2/health/live", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
        assert not answers  # still running
        assert leases.zcard(LEASES) == 1  # and its lease still held
        (gates / "release-1").touch()
        thread.join(60)
        assert answers == [200]
        assert server.process.wait(timeout=60) is not None
        assert leases.zcard(LEASES) == 0
        assert leases.zcard("infergate:replicas:") == 0  # it left the count


def test_leases_of_requests_cut_off_by_the_drain_are_released(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    leases = redis_server.client()
    try:
        with replicas(tmp_path, _profile(redis_server, 1), 1, gates) as (server,):
            assert server.process is not None
            answers: list[int] = []
            threads = [_hold(server, answers) for _ in range(2)]
            wait_until(lambda: leases.zcard(LEASES) == 2, 60, "two leases")
            server.process.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(60)
            assert answers == [503, 503]  # past the drain time
            assert server.process.wait(timeout=60) is not None
            assert leases.zcard(LEASES) == 0
    finally:
        (gates / "release-1").touch()
