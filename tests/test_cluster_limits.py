"""Tenant limits shared by three replicas through a real Redis (issue 17): the rate is one
GCRA in Redis, the concurrency one set of leases, whichever replica a request reaches."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import orjson
import pytest
import redis as redis_py

from infergate.engine.admission.tenants import hash_key
from infergate.engine.cluster import scripts
from tests.cluster_setup import cluster_profile, replicas, running_redis
from tests.polling import wait_until
from tests.redis_server import RedisProcess
from tests.scrape import metric
from tests.scripted_runtime import holding, scripted_inputs
from tests.server import ServerProcess

pytestmark = pytest.mark.slow


def _infer(client: httpx.Client, server: ServerProcess, **controls: int) -> httpx.Response:
    return client.post(f"{server.url}/v2/models/m/infer", json=scripted_inputs(**controls))


def _quick(client: httpx.Client, server: ServerProcess) -> httpx.Response:
    """A call to a model that is never held: admitted, it answers at once."""
    return client.post(f"{server.url}/v2/models/quick/infer", json=scripted_inputs())


# Issue 17's case, 50 rps with burst 10 over three replicas, for 6 s instead of its 20: the
# verdict does not need more (the bound is 50 x 6 + 11 = 311; three replicas each admitting
# the rate alone would admit about 930, a burst of each replica's own about 330, a rate 10%
# too high about 341), and the 20 s run was the suite's longest test (3,000 requests). The
# clients offer three times the rate, paced, so the limit is pressed on any machine (more
# than twice what may be admitted is sent) without tens of thousands of requests.
RATE, BURST, SECONDS = 50, 10, 6.0
CLIENTS, OFFERED_RPS = 9, 150
RATED_KEY = "rated-key"
TTL = 2.0


@pytest.fixture(scope="module")
def trio(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisProcess, list[ServerProcess], Path]]:
    """Three replicas sharing one Redis, for the two tests below (a replica's start costs
    more CPU than either's own work): the default tenant held to 8 requests at once with
    leases of TTL s, and tenant `rated` (RATED_KEY) to RATE a second with a burst of BURST.
    A minute's socket timeout: no Redis outage is tested here, and on a busy machine a slow
    answer must not send a replica to its local share, which would blur what is measured
    (500 ms was not enough in a full parallel run: two calls timed out at the start of the
    rate test, the breaker opened, and the replica's own decisions admitted 12 too many).
    And the gates of `m`."""
    root = tmp_path_factory.mktemp("trio")
    gates = root / "gates"
    gates.mkdir()
    with running_redis(root / "redis") as redis:
        profile = cluster_profile(
            redis, f"socket_timeout_ms = 60000\nlease_ttl_s = {TTL}", "max_concurrency = 8"
        )
        profile += f"""
[tenants.rated]
class = "batch"
rps = {RATE}
burst = {BURST}
api_keys = ["{hash_key(RATED_KEY)}"]
"""
        with replicas(root, profile, 3, gates) as servers:
            yield redis, servers, gates


@pytest.fixture
def three(
    trio: tuple[RedisProcess, list[ServerProcess], Path],
) -> tuple[RedisProcess, list[ServerProcess], Path]:
    """The three replicas, each running (the lease test kills one)."""
    for server in trio[1]:
        if server.process is not None and server.process.poll() is not None:
            server.start()
    return trio


def test_three_replicas_admit_one_rate_between_them(
    three: tuple[RedisProcess, list[ServerProcess], Path],
) -> None:
    _, servers, _ = three
    body = orjson.dumps(scripted_inputs())
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {RATED_KEY}"}
    statuses: list[int] = []
    lock = threading.Lock()
    started = time.monotonic()
    stop_at = started + SECONDS

    def hammer(index: int) -> None:
        every = CLIENTS / OFFERED_RPS  # an open-loop schedule: late sends go at once
        due = started + index * every / CLIENTS
        # http.client, not httpx: half the client's CPU a request, over thousands of
        # them (one kept-alive connection per client, as httpx's would be).
        connection = http.client.HTTPConnection("127.0.0.1", servers[index % 3].port, 30)
        try:
            while (now := time.monotonic()) < stop_at:
                if due > now:
                    time.sleep(due - now)  # pacing the load, not waiting for a state
                due += every
                connection.request("POST", "/v2/models/quick/infer", body, headers)
                with connection.getresponse() as answer:
                    answer.read()
                    with lock:
                        statuses.append(answer.status)
        finally:
            connection.close()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started  # first request sent to last answer
    admitted = statuses.count(200)
    bound = RATE * elapsed + BURST + 1
    print(f"{len(statuses)} requests in {elapsed:.2f} s, {admitted} admitted (<= {bound:.0f})")
    assert set(statuses) <= {200, 429}
    assert len(statuses) > 2 * bound, "the test sent too little to press the limit"
    assert admitted <= bound
    # Each replica alone would have admitted RATE a second: so the three shared one.
    assert admitted >= RATE * elapsed / 2


def _send_held(server: ServerProcess, answers: list[int]) -> threading.Thread:
    def send() -> None:
        with httpx.Client(timeout=120) as client:
            try:
                answers.append(_infer(client, server, hold=1).status_code)
            except httpx.HTTPError:  # its replica was killed
                answers.append(-1)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_eight_leases_across_replicas_and_a_dead_replica_frees_its_own(
    three: tuple[RedisProcess, list[ServerProcess], Path],
) -> None:
    redis_server, servers, gates = three
    leases = redis_server.client()
    key = "infergate:leases:default"
    answers: list[int] = []
    threads = [_send_held(servers[i % 3], answers) for i in range(8)]
    wait_until(lambda: leases.zcard(key) == 8, 60, "8 leases taken")
    with httpx.Client(timeout=30) as client:
        for i in range(6):  # a ninth is refused by every replica
            refused = _quick(client, servers[i % 3])
            assert refused.status_code == 429, refused.text
            assert "max_concurrency" in refused.json()["error"]
    assert not answers  # all eight still in flight

    dead = servers[0]  # holds three of the eight
    assert dead.process is not None
    os.killpg(dead.process.pid, signal.SIGKILL)
    dead.process.wait()
    killed_at = redis_server.now()
    # Every lease expires at most one TTL after its last renewal, which came before this
    # read (a live replica may renew one between the kill's clock and the read: by 21 us
    # once, past a bound read at the kill).
    held = cast(list[tuple[bytes, float]], leases.zrange(key, 0, -1, withscores=True))
    read_at = redis_server.now()
    scores = [score for _, score in held]
    assert max(scores) <= (read_at + TTL) * 1e6

    # Refused, an admission ran before some dead lease expired (Redis's clock, as the
    # script reads it), so each refused attempt was asked before the last dead expiry:
    # one after it would be a slot held past its TTL. Clocked by Redis both ways, this
    # holds on any machine, however slow the polls.
    dead_by = max(scores) / 1e6
    refused_at: list[float] = []
    with httpx.Client(timeout=30) as client:

        def free_now() -> float | None:
            asked_at = redis_server.now()
            if _quick(client, servers[1]).status_code == 200:
                return asked_at
            refused_at.append(asked_at)
            return None

        freed = wait_until(free_now, 30, "a slot of the dead replica")
    print(f"slots free {freed - killed_at:.2f} s after kill -9 (TTL {TTL} s)")
    late = [round(t - dead_by, 3) for t in refused_at if t >= dead_by]
    assert not late, f"refused this long (s) after every dead lease had expired: {late}"

    # Every dead lease has expired by now (the live ones were renewed since), so that
    # a stale one the admission script has not swept yet cannot count as a new one.
    wait_until(lambda: redis_server.now() * 1e6 > max(scores), 30, "the dead leases' TTL")
    # Three slots came back, and no more: 5 held + 3 new = 8, a ninth is refused.
    threads += [_send_held(servers[1 + i % 2], answers) for i in range(3)]
    wait_until(lambda: leases.zcard(key) == 8, 60, "8 leases again")
    with httpx.Client(timeout=30) as client:
        assert _quick(client, servers[2]).status_code == 429
    (gates / "release-1").touch()
    for t in threads:
        t.join(120)
    assert sorted(answers) == [-1] * 3 + [200] * 8  # the dead replica's three: no answer
    assert wait_until(lambda: leases.zcard(key) == 0, 30, "every lease returned")


@pytest.fixture(scope="module")
def lease_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisProcess, list[ServerProcess], Path]]:
    """Two replicas holding the default tenant to one request at a time, with a lease TTL
    longer than the file (no renewal runs) and a minute's socket timeout (a busy machine's
    slow answer never sends them to their local share), sharing one Redis; and the gates
    of their `m`. For the tests below, which each leave every lease returned: a replica's
    start costs more CPU than any of them."""
    root = tmp_path_factory.mktemp("leases")
    gates = root / "gates"
    gates.mkdir()
    with running_redis(root / "redis") as redis:
        profile = cluster_profile(
            redis, "socket_timeout_ms = 60000\nlease_ttl_s = 600", "max_concurrency = 1"
        )
        with replicas(root, profile, 2, gates) as servers:
            yield redis, servers, gates


def _counter(servers: list[ServerProcess], name: str, **labels: str) -> float:
    return sum(metric(s, name, absent=0, **labels) for s in servers)


def test_script_flush_is_survived(
    lease_pair: tuple[RedisProcess, list[ServerProcess], Path],
) -> None:
    redis_server, servers, _ = lease_pair
    server = servers[0]
    admit_sha = hashlib.sha1(scripts.ADMIT.encode()).hexdigest()
    errors = "infergate_cluster_redis_errors_total"
    without = "infergate_cluster_decisions_without_redis_total"

    def counts() -> tuple[float, float]:
        return _counter(servers, errors, op="admit"), _counter(servers, without)

    with httpx.Client(timeout=30) as client:
        assert _quick(client, server).status_code == 200
        before = counts()
        redis_server.client().script_flush()
        assert redis_server.client().script_exists(admit_sha) == [False]
        assert _quick(client, server).status_code == 200
        # Reloaded, not bypassed: no error, no decision taken without Redis.
        assert counts() == before
        assert redis_server.client().script_exists(admit_sha) == [True]


def _sent_commands(redis: redis_py.Redis) -> dict[str, int]:
    """Calls of each command clients sent Redis so far (INFO commandstats counts those the
    scripts run too: left out), this client's INFO aside."""
    in_scripts = {
        n.lower() for n in re.findall(r"redis\.call\('(\w+)'", scripts.ADMIT + scripts.RENEW)
    }
    stats = redis.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    return {k: n for k, n in calls.items() if k not in in_scripts and k != "info"}


def _asked_again(servers: list[ServerProcess]) -> float:
    return sum(metric(s, "infergate_cluster_admissions_asked_again_total") for s in servers)


def test_one_request_after_another_is_never_refused_by_its_own_lease(
    lease_pair: tuple[RedisProcess, list[ServerProcess], Path],
) -> None:
    """The lease is released before the answer is sent, without waiting for Redis, yet
    before the client's next request can ask for the slot, on the same replica or another;
    each request costs one admission script and one release, nothing more."""
    redis_server, servers, _ = lease_pair
    with httpx.Client(timeout=30) as client:
        assert [_quick(client, servers[i % 2]).status_code for i in range(10)] == [200] * 10
        stats = redis_server.client()  # one connection for both counts
        before, again_before = _sent_commands(stats), _asked_again(servers)
        statuses = [_quick(client, servers[i % 2]).status_code for i in range(300)]
        assert statuses == [200] * 300
        sent = _sent_commands(stats)
        added = {k: n - before.get(k, 0) for k, n in sent.items() if n != before.get(k, 0)}
        # A second admission only for a request whose first found the slot still taken (the
        # previous request's release, from the other replica, not yet applied).
        again = _asked_again(servers) - again_before
        assert added == {"evalsha": 300 + again, "zrem": 300}
        print(f"asked again: {again:.0f} of 300")


def test_an_answer_never_waits_for_its_lease_release(
    lease_pair: tuple[RedisProcess, list[ServerProcess], Path],
) -> None:
    """With Redis stopped (SIGSTOP) after a request was admitted, its answer still goes
    out at once (the release is written, not waited for, even with a minute's socket
    timeout); the slot is free as soon as Redis runs again, long before the lease's TTL.

    Admitted means held in its worker, which the request reaches only once the replica has
    read the admission's reply. Its lease in Redis is not enough: Redis may write the
    reply to this test's ZCARD before the one to the admission script that added the lease,
    and a Redis stopped between the two leaves the admission waiting out its minute (seen
    in about 1 in 6 full parallel runs, and reproduced by looping the test under load: the
    replica logged the admission only after SIGCONT)."""
    redis_server, servers, gates = lease_pair
    leases = redis_server.client()
    key = "infergate:leases:default"
    answers: list[int] = []
    thread = _send_held(servers[0], answers)
    wait_until(lambda: holding(gates, 1), 60, "the request held in its worker")
    assert leases.zcard(key) == 1
    redis_server.signal(signal.SIGSTOP)
    try:
        (gates / "release-1").touch()
        wait_until(lambda: answers, 30, "the answer, while Redis is stopped")
        assert answers == [200]
    finally:
        redis_server.signal(signal.SIGCONT)
    thread.join(30)
    wait_until(lambda: leases.zcard(key) == 0, 30, "the release, once Redis runs")
    with httpx.Client(timeout=30) as client:
        assert _quick(client, servers[1]).status_code == 200  # the slot, elsewhere
