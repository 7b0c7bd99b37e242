"""Redis killed, stopped (SIGSTOP) or paused (CLIENT PAUSE) under a replica (issue 17):
requests never wait more than the socket timeout for it, the replica enforces its share
of each limit meanwhile (fail_mode local), and goes back to Redis when it answers again."""

from __future__ import annotations

import http.client
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.cluster_setup import cluster_profile, replicas, running_redis
from tests.polling import wait_until
from tests.redis_server import RedisProcess
from tests.scrape import metric
from tests.scripted_runtime import scripted_inputs
from tests.server import ServerProcess

pytestmark = pytest.mark.slow

TIMEOUT_S = 0.1
RATE, BURST, REPLICAS = 30, 6, 3  # this replica's share: 10 rps, burst 2
PHASE_S = 2.0
# The client sends at a steady pace, not as fast as it can: the phases last PHASE_S on any
# machine, and a closed loop would burn a core for all of it. 300 a second press the share
# (10 a second) and give each phase 600 latencies: the few requests that wait out the
# timeout before the replica stops asking Redis (the outage's first few tenths of a
# second) stay above the 99th percentile.
SENDS_PER_S = 300
BODY = orjson.dumps(scripted_inputs())
JSON = {"Content-Type": "application/json"}


def _phase(server: ServerProcess) -> tuple[list[float], int, float]:
    """One client sending one request after another, paced, for PHASE_S: each request's
    latency, how many were admitted, and how long it took."""
    latencies, admitted = [], 0
    # http.client, not httpx: half the client's CPU a request.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    started = due = time.monotonic()
    try:
        while (now := time.monotonic()) - started < PHASE_S:
            if due > now:
                time.sleep(due - now)  # pacing the load, not waiting for a state
            due += 1 / SENDS_PER_S  # an open-loop schedule: late sends go at once
            sent = time.perf_counter()
            connection.request("POST", "/v2/models/m/infer", BODY, JSON)
            with connection.getresponse() as answer:
                answer.read()
            latencies.append(time.perf_counter() - sent)
            assert answer.status in (200, 429)
            admitted += answer.status == 200
    finally:
        connection.close()
    return latencies, admitted, time.monotonic() - started


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _kill(redis: RedisProcess) -> Callable[[], None]:
    redis.kill()

    def restart() -> None:
        redis.start()

    return restart


def _stop(redis: RedisProcess) -> Callable[[], None]:
    redis.signal(signal.SIGSTOP)
    return lambda: redis.signal(signal.SIGCONT)


def _pause(redis: RedisProcess) -> Callable[[], None]:
    # A paused Redis does not take CLIENT UNPAUSE either: the pause ends by itself.
    redis.client().client_pause(int(PHASE_S * 1000 + 500), all=True)
    return lambda: None


def _decided_without_redis(server: ServerProcess, **labels: str) -> float:
    name = "infergate_cluster_decisions_without_redis_total"
    return metric(server, name, absent=0, **labels)


def _via_redis(server: ServerProcess, client: httpx.Client) -> bool:
    """Whether a request was admitted through Redis (decisions without it did not grow)."""
    before = _decided_without_redis(server)
    client.post(f"{server.url}/v2/models/m/infer", json=scripted_inputs())
    return _decided_without_redis(server) == before


@pytest.fixture(scope="module")
def outage_setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisProcess, ServerProcess]]:
    """One Redis and one replica for the three outages (a replica's start costs more CPU
    than a test's two phases): each test ends with the replica back on Redis, and the
    counters it reads are read as differences."""
    root = tmp_path_factory.mktemp("outage")
    with running_redis(root / "redis") as redis:
        profile = cluster_profile(
            redis,
            f"socket_timeout_ms = {TIMEOUT_S * 1000:g}\nreplicas = {REPLICAS}",
            f"rps = {RATE}\nburst = {BURST}",
        )
        with replicas(root, profile, 1) as (server,):
            yield redis, server


@pytest.fixture
def on_redis(
    outage_setup: tuple[RedisProcess, ServerProcess],
) -> tuple[RedisProcess, ServerProcess]:
    """The shared replica deciding through a running Redis, whatever a test before left."""
    redis, server = outage_setup
    assert redis.process is not None
    if redis.process.poll() is not None:
        redis.start()
    redis.signal(signal.SIGCONT)
    with httpx.Client(timeout=30) as client:
        wait_until(lambda: _via_redis(server, client), 30, "decisions through Redis")
    return redis, server


@pytest.mark.parametrize("outage", [_kill, _stop, _pause], ids=["kill", "sigstop", "pause"])
def test_an_outage_costs_at_most_the_timeout_and_admits_the_local_share(
    on_redis: tuple[RedisProcess, ServerProcess],
    outage: Callable[[RedisProcess], Callable[[], None]],
) -> None:
    redis, server = on_redis
    with httpx.Client(timeout=30) as client:
        healthy, _, _ = _phase(server)
        local_before = _decided_without_redis(server, fail_mode="local")
        errors = "infergate_cluster_redis_errors_total"
        errors_before = metric(server, errors, absent=0, op="admit")
        restore = outage(redis)
        broken, admitted, seconds = _phase(server)
        restore()

        share_bound = RATE / REPLICAS * seconds + BURST / REPLICAS + 1
        print(
            f"healthy p99 {_p99(healthy) * 1000:.1f} ms, outage p99 {_p99(broken) * 1000:.1f} "
            f"ms; {admitted} admitted in {seconds:.2f} s (share <= {share_bound:.1f})"
        )
        assert admitted <= share_bound
        assert admitted >= 1  # the replica still serves: its share, not nothing
        assert _p99(broken) <= _p99(healthy) + TIMEOUT_S
        local = metric(server, "infergate_cluster_decisions_without_redis_total", fail_mode="local")
        assert local > local_before
        assert metric(server, errors, op="admit") > errors_before

        # Back to Redis once it answers: decisions without it stop.
        wait_until(lambda: _via_redis(server, client), 30, "decisions through Redis again")


@pytest.mark.parametrize(("mode", "status"), [("open", 200), ("closed", 503)])
def test_fail_mode_open_admits_and_closed_refuses(
    tmp_path: Path, redis_server: RedisProcess, mode: str, status: int
) -> None:
    profile = cluster_profile(
        redis_server, f'fail_mode = "{mode}"', "rps = 1\nburst = 1\nmax_concurrency = 1"
    )
    with replicas(tmp_path, profile, 1) as (server,), httpx.Client(timeout=30) as client:
        redis_server.kill()
        answers = [
            client.post(f"{server.url}/v2/models/m/infer", json=scripted_inputs()) for _ in range(5)
        ]
        assert [a.status_code for a in answers] == [status] * 5  # the limit is 1 a second
        if status == 503:
            assert answers[0].headers["retry-after"] == "1"
            assert 'fail_mode is "closed"' in answers[0].json()["error"]
        counted = metric(server, "infergate_cluster_decisions_without_redis_total", fail_mode=mode)
        assert counted == 5
