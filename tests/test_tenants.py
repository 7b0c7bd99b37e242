"""Tenants and protection on a real server: keys, limits, allow-lists, breakers that trip
on real failing and slow models and recover, a flooding tenant that cannot hurt another,
and a profile that changes live, persists, and survives kill -9."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infergate.engine.admission.tenants import hash_key
from infergate.profile import load_profile
from tests.onnx_models import make_fails_on_demand, make_mlp
from tests.polling import wait_until
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

ADMIN, ALICE, BOB, MALLORY = "admin-key", "alice-key", "bob-key", "mallory-key"

PROFILE = f"""
# infergate test profile
[server]
allow_anonymous = false
admin_keys = ["{hash_key(ADMIN)}"]

[breaker]
window_seconds = 2
failure_rate = 0.5
latency_p99_ms = 60000  # only `slow` trips on latency: a busy machine must not trip mlp
consecutive_windows = 2
min_requests = 4
backoff_initial_s = 3  # the open breaker is looked at within it, by a few calls
backoff_max_s = 4
probes = 2

[breaker.models.slow]
latency_p99_ms = 150

[tenants.alice]
class = "burst"
rps = 5
burst = 5
models = ["mlp", "flaky", "slow"]
api_keys = ["{hash_key(ALICE)}"]

[tenants.mallory]
class = "burst"
rps = 5
burst = 5
api_keys = ["{hash_key(MALLORY)}"]

[tenants.bob]
class = "burst"
rps = 100000
burst = 100000
max_concurrency = 4
api_keys = ["{hash_key(BOB)}"]
"""


def _start_tenant_server(folder: Path, breakers: bool = True) -> ServerProcess:
    """mlp and other; with `breakers`, flaky and slow too (the breaker tests' models)."""
    models = folder / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    make_mlp(models / "other" / "1" / "model.onnx", seed=9)
    if breakers:
        make_fails_on_demand(models / "flaky" / "1" / "model.onnx")
        make_scripted(models / "slow" / "1" / "model.scripted", ("sleep_ms",))
    profile = folder / "profile.toml"
    profile.write_text(PROFILE)
    return ServerProcess(models, profile, folder / "server.log").start()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """For the tests that change nothing another test reads: each uses its own tenant's
    limits (alice's rate, mallory's) and its own model's breaker (flaky, slow)."""
    proc = _start_tenant_server(tmp_path_factory.mktemp("tenants"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = _start_tenant_server(tmp_path_factory.mktemp("own"), breakers=False)
    yield proc
    proc.stop()


@pytest.fixture
def tenant_server(own_server: ServerProcess) -> ServerProcess:
    """The server of the tests that change the profile or stop the server, shared by them:
    each starts from PROFILE as written (restored, applied, the server started again if a
    test left it stopped), whatever ran before."""
    if own_server.profile.read_text() != PROFILE:
        own_server.profile.write_text(PROFILE)
    if own_server.process is None or own_server.process.poll() is not None:
        own_server.start()
    wait_until(lambda: as_written(own_server), what="the profile as written to apply")
    return own_server


def as_written(server: ServerProcess) -> bool:
    """Whether the server applies PROFILE: no rejected edit, its tenants as it says, no
    breaker of its own for mlp."""
    doc = httpx.get(f"{server.url}/admin/tenants", headers={"X-API-Key": ADMIN}).json()
    tenants = {t["name"]: t for t in doc["tenants"]}
    return (
        doc["profile_error"] is None
        and tenants.keys() == {"alice", "bob", "mallory"}
        and tenants["alice"]["models"] == ["mlp", "flaky", "slow"]
        and tenants["bob"]["rps"] == 100000
        and breaker_state(server, "mlp")["policy"]["failure_rate"] == 0.5
    )


def call(
    server: ServerProcess, model: str, key: str | None, body: dict[str, Any] | None = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = body or {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]
    }
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer", json=body, headers=headers, timeout=30
    )


def flaky(mode: int) -> dict[str, Any]:
    return {"inputs": [{"name": "mode", "datatype": "INT64", "shape": [1], "data": [mode]}]}


def test_keys_allow_lists_and_rates(shared_server: ServerProcess) -> None:
    assert call(shared_server, "mlp", None).status_code == 401
    response = call(shared_server, "mlp", "wrong")
    assert response.status_code == 401
    assert "unknown API key" in response.json()["error"]
    one_row = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    url = f"{shared_server.url}/v2/models/mlp/infer"
    x_api_key = httpx.post(url, headers={"X-API-Key": BOB}, json=one_row)
    assert x_api_key.status_code == 200
    # Two different keys: which one it runs as is not guessed. A Bearer naming no key is a
    # client that meant to send one, not an anonymous caller.
    both = httpx.post(
        url, headers={"X-API-Key": BOB, "Authorization": f"Bearer {ALICE}"}, json=one_row
    )
    assert both.status_code == 400
    assert "two different keys" in both.json()["error"]
    same = httpx.post(
        url, headers={"X-API-Key": BOB, "Authorization": f"Bearer {BOB}"}, json=one_row
    )
    assert same.status_code == 200
    # One header twice: the last one ran, so a client's header after a proxy's won.
    for name, values in (
        ("Authorization", [f"Bearer {BOB}", f"Bearer {ALICE}"]),
        ("X-API-Key", [BOB, ALICE]),
    ):
        twice = httpx.post(url, headers=[(name, v) for v in values], json=one_row)
        assert twice.status_code == 400, (name, twice.text)
        assert f"sends {name.lower()} twice, with different values" in twice.json()["error"]
    repeated = httpx.post(url, headers=[("X-API-Key", BOB), ("X-API-Key", BOB)], json=one_row)
    assert repeated.status_code == 200
    empty = httpx.post(
        url, headers={"X-API-Key": "", "Authorization": f"Bearer {BOB}"}, json=one_row
    )
    assert empty.status_code == 200  # an empty X-API-Key names no key
    bare = httpx.post(url, headers={"Authorization": "Bearer"}, json=one_row)
    assert bare.status_code == 401
    assert "names no key" in bare.json()["error"]
    forbidden = call(shared_server, "other", ALICE)
    assert forbidden.status_code == 403
    assert "may not use model 'other'" in forbidden.json()["error"]
    responses: list[httpx.Response] = []
    # One kept-alive connection: a request costs a few ms of CPU, not a new client's set-up
    # (tens of ms), so the calls come faster than 5/s on a machine 4x busier too.
    with httpx.Client(headers={"Authorization": f"Bearer {ALICE}"}, timeout=30) as client:
        x = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
        body = {"inputs": [x]}
        while len(responses) < 50 and 429 not in (r.status_code for r in responses):
            responses.append(client.post(f"{shared_server.url}/v2/models/mlp/infer", json=body))
    codes = [r.status_code for r in responses]
    assert codes[:5] == [200] * 5  # the burst
    assert 429 in codes
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["Retry-After"] == "1"  # 5/s: a token within a second
    assert "over its rate of 5 requests/s" in limited.json()["error"]
    assert call(shared_server, "mlp", BOB).status_code == 200  # bob is not affected


def test_admin_endpoints_need_the_admin_key(shared_server: ServerProcess) -> None:
    url = f"{shared_server.url}/admin/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {BOB}"}).status_code == 403
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    index = httpx.post(f"{shared_server.url}/v2/repository/index")
    assert index.status_code == 401
    assert "error" in index.json()
    assert httpx.get(f"{shared_server.url}/v2/health/ready").status_code == 200  # open


def breaker_state(server: ServerProcess, model: str) -> dict[str, Any]:
    rows = httpx.get(
        f"{server.url}/admin/breakers", headers={"Authorization": f"Bearer {ADMIN}"}
    ).json()
    return next(r for r in rows if r["model"] == model)


def test_failures_trip_the_breaker_and_it_recovers(shared_server: ServerProcess) -> None:
    # Failures until the breaker opens. It opens on its own tick, two evaluations after the
    # 4th failure (min_requests), however many calls a busy machine gets in meanwhile.
    codes: list[int] = []

    def fail_until_open() -> httpx.Response | None:
        response = call(shared_server, "flaky", BOB, flaky(1))
        codes.append(response.status_code)
        return response if response.status_code == 503 else None

    opened = wait_until(fail_until_open, what="the breaker to open")
    assert set(codes[:-1]) == {500}  # every failure answered as one until it opened
    assert len(codes[:-1]) >= 4  # not before min_requests failures
    assert "circuit breaker" in opened.json()["error"]
    assert "failure rate" in opened.json()["error"]
    assert int(opened.headers["Retry-After"]) >= 1
    # A good request is refused too while it is open; other models serve throughout.
    open_row = breaker_state(shared_server, "flaky")
    assert open_row["state"] == "open"
    assert "failure rate" in open_row["reason"]
    assert isinstance(open_row["retry_after_s"], float)
    assert call(shared_server, "flaky", BOB, flaky(0)).status_code == 503
    assert call(shared_server, "mlp", BOB).status_code == 200
    # After the backoff, good probes close it.
    wait_until(
        lambda: call(shared_server, "flaky", BOB, flaky(0)).status_code == 200,
        timeout_s=10,
        what="a probe to pass",
    )
    assert call(shared_server, "flaky", BOB, flaky(0)).status_code == 200
    closed = breaker_state(shared_server, "flaky")
    assert closed["state"] == "closed"
    assert (closed["reason"], closed["retry_after_s"]) == ("probes succeeded", None)
    events = httpx.get(
        f"{shared_server.url}/admin/models/flaky", headers={"Authorization": f"Bearer {ADMIN}"}
    ).json()["events"]
    kinds = [e["kind"] for e in events]
    assert (
        kinds.index("breaker_open")
        < kinds.index("breaker_half_open")
        < kinds.index("breaker_closed")
    )


def test_slow_answers_trip_the_breaker(shared_server: ServerProcess) -> None:
    slow = scripted_inputs(sleep_ms=200)  # over the 150 ms p99 limit, on any machine
    codes: list[int] = []
    while 503 not in codes and len(codes) < 40:
        codes.append(call(shared_server, "slow", BOB, slow).status_code)
    assert codes[-1] == 503
    assert set(codes[:-1]) == {200}  # they all succeeded, just too slowly
    assert "p99 latency" in breaker_state(shared_server, "slow")["reason"]
    assert call(shared_server, "mlp", BOB).status_code == 200


def test_a_flooding_tenant_does_not_hurt_another(shared_server: ServerProcess) -> None:
    stop = threading.Event()
    flood: list[int] = []

    def flooder() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                flood.append(
                    http.post(
                        f"{shared_server.url}/v2/models/mlp/infer",
                        headers={"Authorization": f"Bearer {MALLORY}"},
                        json={
                            "inputs": [
                                {
                                    "name": "x",
                                    "datatype": "FP32",
                                    "shape": [1, 4],
                                    "data": [1, 2, 3, 4],
                                }
                            ]
                        },
                    ).status_code
                )

    threads = [threading.Thread(target=flooder) for _ in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    codes: list[int] = []
    try:
        wait_until(lambda: len(flood) >= 4, what="the flood to start")
        for _ in range(30):
            codes.append(call(shared_server, "mlp", BOB).status_code)
    finally:
        stop.set()
        for t in threads:
            t.join()
        flooded_s = time.monotonic() - started
    assert codes == [200] * 30  # none was refused, shed or late for its queue deadline
    # Mallory was held to her 5 requests/s: refused, and never more than her burst of 5 and
    # 5 a second let through (a count against her own rate, whatever the flood's speed).
    assert 429 in flood
    assert flood.count(200) <= 5 + 5 * flooded_s, (flood.count(200), flooded_s)


def admin(server: ServerProcess, *args: str) -> tuple[int, str]:
    from tests.test_cli import run

    return run(*args, "--url", server.url, "--token", ADMIN)


def admin_split(server: ServerProcess, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr apart."""
    from infergate.cli.main import app
    from tests.test_cli import runner

    result = runner.invoke(app, [*args, "--url", server.url, "--token", ADMIN])
    return result.exit_code, result.stdout, result.stderr


def test_cli_tenant_changes_apply_persist_and_survive_restart(
    tenant_server: ServerProcess,
) -> None:
    code, out = admin(tenant_server, "tenant", "add", "carol", "rps=50", "models=mlp")
    assert code == 0, out
    key = out.strip().splitlines()[-1]
    assert key.startswith("ig_")
    assert call(tenant_server, "mlp", key).status_code == 200
    assert call(tenant_server, "other", key).status_code == 403
    assert key not in tenant_server.profile.read_text()  # only its hash is stored
    assert "# infergate test profile" in tenant_server.profile.read_text()  # comments kept
    code, out = admin(tenant_server, "tenant", "set", "carol", "models=mlp,other")
    assert code == 0, out
    assert call(tenant_server, "other", key).status_code == 200
    code, out = admin(tenant_server, "tenant", "set", "carol", "rps=-3")
    assert code == 1
    assert "tenants.carol.rps: expected a number >= 0" in out
    code, out = admin(tenant_server, "tenant", "list", "--json")
    assert {t["name"] for t in __import__("json").loads(out)} == {
        "alice",
        "bob",
        "carol",
        "mallory",
    }
    code, out = admin(tenant_server, "breaker", "set", "mlp", "failure_rate=0.2")
    assert code == 0, out
    tenant_server.stop()
    tenant_server.start()
    assert call(tenant_server, "other", key).status_code == 200
    assert breaker_state(tenant_server, "mlp")["policy"]["failure_rate"] == 0.2
    code, _ = admin(tenant_server, "tenant", "remove", "carol")
    assert code == 0
    assert call(tenant_server, "mlp", key).status_code == 401


def test_live_profile_edit_applies_and_a_broken_one_is_rejected(
    tenant_server: ServerProcess,
) -> None:
    text = tenant_server.profile.read_text()
    tenant_server.profile.write_text(
        text.replace('models = ["mlp", "flaky", "slow"]', 'models = ["mlp", "other"]')
    )
    wait_until(
        lambda: (
            call(tenant_server, "other", BOB).status_code == 200
            and call(tenant_server, "other", ALICE).status_code in (200, 429)
        ),
        what="the edit to apply",
    )
    tenant_server.profile.write_text(text.replace("rps = 5", "rps = 'fast'", 1))
    wait_until(
        lambda: "last edit was rejected" in admin_split(tenant_server, "tenant", "list")[2],
        what="the rejection",
    )
    code, out, err = admin_split(tenant_server, "tenant", "list", "--json")
    assert "tenants.alice.rps: expected a number" in err  # a warning; stdout stays JSON
    alice = next(t for t in __import__("json").loads(out) if t["name"] == "alice")
    assert alice["models"] == ["mlp", "other"]  # the last good profile still serves
    assert call(tenant_server, "mlp", BOB).status_code == 200


def test_kill_9_during_changes_leaves_a_valid_profile(tenant_server: ServerProcess) -> None:
    acked: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        with httpx.Client(timeout=5, headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    r = http.patch(f"{tenant_server.url}/admin/tenants/bob", json={"rps": i})
                except httpx.HTTPError:
                    return  # the server is gone
                if r.status_code == 200:
                    acked.append(i)

    thread = threading.Thread(target=writer)
    thread.start()
    wait_until(lambda: len(acked) >= 5, what="some changes to land")
    assert tenant_server.process is not None
    os.killpg(tenant_server.process.pid, signal.SIGKILL)  # in the middle of the stream
    tenant_server.process.wait()
    stop.set()
    thread.join()
    profile = load_profile(tenant_server.profile)  # parses and validates whole
    bob = next(t for t in profile.tenants if t.name == "bob")
    assert bob.rps >= acked[-1]  # every acknowledged change is on disk
    assert bob.rps <= acked[-1] + 1  # plus at most the one in flight
    tenant_server.start()
    assert call(tenant_server, "mlp", BOB).status_code == 200
