"""The remote runtime end to end: a real `infergate serve` in front of upstreams on
loopback (another infergate, and tests/remote_upstream.py whose failures the test sets)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from infergate.client import encode_infer_request
from infergate.engine.admission.tenants import hash_key
from tests.conftest import write_profile
from tests.edge_raw import big_json_body
from tests.health_probe import slow_answers, upload_while_probing
from tests.polling import wait_until
from tests.remote_upstream import Upstream
from tests.scrape import metric
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess, free_port

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def remote_toml(endpoints: list[str], extra: str = "", remote_extra: str = "") -> str:
    listed = ", ".join(f'"{e}"' for e in endpoints)
    return (
        f'runtime = "remote"\n{extra}\n[remote]\nendpoints = [{listed}]\n'
        f'model = "remote-mlp"\n{remote_extra}\n'
    )


LIMITED_KEY = "limited-key"
# One gateway for the file. Each test adds models of its own (remote, on upstreams of its
# own) and they go when it ends, so a test sees only its models' series. The breaker and
# the rate limit some tests need are scoped to a model (flaky) and a tenant (limited).
PROFILE = f"""
[server]
max_request_mb = 1
file_stable_s = 0.2
[breaker.models.flaky]
window_seconds = 2
failure_rate = 0.5
min_requests = 4
consecutive_windows = 1
backoff_initial_s = 30
[tenants.default]
[tenants.limited]
rps = 0.01
burst = 2
api_keys = ["{hash_key(LIMITED_KEY)}"]
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("gateway")
    (folder / "models").mkdir()
    proc = ServerProcess(folder / "models", write_profile(folder, PROFILE), folder / "log")
    yield proc.start()
    proc.stop()


@pytest.fixture
def upstreams() -> Iterator[list[Upstream]]:
    started: list[Upstream] = []
    yield started
    for upstream in started:
        upstream.stop()


@pytest.fixture
def gw(gateway: ServerProcess, upstreams: list[Upstream]) -> Iterator[ServerProcess]:
    """The shared gateway; the models the test added go when it ends, before the
    upstreams they point at stop (set up after `upstreams`, so torn down before it)."""
    yield gateway
    names = [p.name for p in gateway.models.iterdir()]
    for name in names:
        shutil.rmtree(gateway.models / name)
    for name in names:
        wait_until(partial(gone, gateway, name), 30, f"{name} to go")


def gone(proc: ServerProcess, name: str) -> bool:
    return status_or_none(proc, name) is None


def status_or_none(proc: ServerProcess, name: str) -> dict[str, Any] | None:
    response = httpx.get(f"{proc.url}/admin/models/{name}", timeout=5)
    return None if response.status_code == 404 else response.raise_for_status().json()


def add(proc: ServerProcess, toml: str | dict[str, str]) -> ServerProcess:
    """Serve `toml` as model `front` (or each model named in a dict): each folder is made
    beside the models folder and moved in whole, so the watcher watches it from the start.
    Back when none of them is loading any more."""
    named = {"front": toml} if isinstance(toml, str) else toml
    for name, text in named.items():
        incoming = proc.models.parent / "incoming" / name
        incoming.mkdir(parents=True)
        (incoming / "model.toml").write_text(text)
        os.replace(incoming, proc.models / name)
    for name in named:

        def loaded(name: str = name) -> bool:
            status = status_or_none(proc, name)
            return status is not None and status["state"] != "loading"

        wait_until(loaded, 30, f"{name} to load")
    return proc


def start_upstreams(started: list[Upstream], count: int) -> list[Upstream]:
    for _ in range(count):
        started.append(Upstream().start())
    return started


@pytest.fixture
def front(gw: ServerProcess, upstreams: list[Upstream]) -> ServerProcess:
    """The gateway, with model `front`: remote-mlp on one recording upstream."""
    (upstream,) = start_upstreams(upstreams, 1)
    add(gw, remote_toml([upstream.url]))
    assert gw.model("front")["state"] == "ready"
    return gw


def infer(
    server: ServerProcess,
    body: bytes,
    headers: dict[str, str],
    model: str = "front",
) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer", content=body, headers=headers, timeout=30
    )


BODY, HEADERS = encode_infer_request({"x": X}, ["y"])
QUIET = "health_interval_s = 600"  # no active checks: what the test sees is the traffic's


def endpoints(proc: ServerProcess, model: str = "front") -> dict[str, dict[str, object]]:
    (version,) = proc.model(model)["versions"]
    return {e["endpoint"]: e for e in version["remote"]["endpoints"]}


def test_bodies_arrive_byte_identical(front: ServerProcess, upstreams: list[Upstream]) -> None:
    binary, binary_headers = encode_infer_request({"x": X}, ["y"], binary=True)
    text, text_headers = encode_infer_request({"x": X}, ["y"], binary=False)
    for body, headers in ((binary, binary_headers), (text, text_headers)):
        response = infer(front, body, headers)
        assert response.status_code == 200, response.text
        assert response.json()["parameters"]["upstream"] == upstreams[0].port
    got = upstreams[0].received
    assert [r.sha256 for r in got] == [
        hashlib.sha256(binary).hexdigest(),
        hashlib.sha256(text).hexdigest(),
    ]
    assert got[0].header_length == binary_headers["Inference-Header-Content-Length"]
    assert got[0].content_type == "application/octet-stream"
    assert got[1].header_length is None
    # Triton's views of it work as for a local model.
    for path in ("config", "stats", "ready"):
        answer = httpx.get(f"{front.url}/v2/models/front/{path}", timeout=5)
        assert answer.status_code == 200, (path, answer.text)
    stats = httpx.get(f"{front.url}/v2/models/front/stats", timeout=5).json()
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == 2


def test_health_checks_keep_requests_off_an_endpoint_that_is_not_ready(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    sick, good = start_upstreams(upstreams, 2)
    checks = "health_interval_s = 0.1\nunhealthy_threshold = 2"
    proc = add(gw, remote_toml([sick.url, good.url], remote_extra=checks))
    sick.ready = False
    wait_until(lambda: endpoints(proc)[sick.url]["healthy"] is False, 30, "it to be out")
    statuses = [infer(proc, BODY, HEADERS).status_code for _ in range(10)]
    assert statuses == [200] * 10
    assert len(sick.received) == 0
    assert metric(proc, "infergate_remote_endpoint_healthy", endpoint=sick.url) == 0
    sick.ready = True
    wait_until(lambda: endpoints(proc)[sick.url]["healthy"] is True, 30, "it to be back")

    def both_used() -> bool:
        assert infer(proc, BODY, HEADERS).status_code == 200
        return len(sick.received) > 0

    wait_until(both_used, 30, "requests to reach it again")


def test_metadata_and_results_come_from_another_infergate(
    tmp_path: Path, gw: ServerProcess
) -> None:
    models = tmp_path / "up-models"
    make_scripted(models / "remote-mlp" / "1" / "model.scripted", ())
    back = ServerProcess(models, write_profile(tmp_path), tmp_path / "log")
    back.start()
    try:
        wait_until(lambda: back.model("remote-mlp")["state"] == "ready", 60, "upstream")
        proc = add(gw, remote_toml([back.url], remote_extra="version = 1"))
        assert proc.model("front")["state"] == "ready"
        ours = httpx.get(f"{proc.url}/v2/models/front", timeout=5).json()
        theirs = httpx.get(f"{back.url}/v2/models/remote-mlp", timeout=5).json()
        assert ours["inputs"] == theirs["inputs"]
        assert ours["outputs"] == theirs["outputs"]
        request = scripted_inputs(rows=2)
        x = request["inputs"][0]["data"]
        body = json.dumps({**request, "outputs": [{"name": "y"}]}).encode()
        response = infer(proc, body, {"content-type": "application/json"})
        assert response.status_code == 200, response.text
        (y,) = response.json()["outputs"]
        assert y["name"] == "y"
        assert y["data"] == x
        shm_round_trip(proc)
    finally:
        shutil.rmtree(gw.models / "front")  # before its upstream goes
        wait_until(partial(gone, gw, "front"), 30, "front to go")
        back.stop()


def test_connection_failures_are_retried_on_another_endpoint(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    gone, good = start_upstreams(upstreams, 2)
    proc = add(gw, remote_toml([gone.url, good.url], remote_extra=QUIET))
    gone.stop()  # after the load: its port now refuses connections
    upstreams.remove(gone)
    statuses = [infer(proc, BODY, HEADERS).status_code for _ in range(20)]
    assert statuses == [200] * 20
    assert len(good.received) == 20
    refused = metric(
        proc, "infergate_remote_attempts_total", model="front", outcome="connect_failed"
    )
    assert (
        metric(proc, "infergate_remote_retries_total", model="front", why="connect_failed")
        == refused
    )
    assert 1 <= refused <= 5  # then outlier detection ejects it


def test_editing_model_toml_moves_the_model_to_other_endpoints(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    first, second = start_upstreams(upstreams, 2)
    proc = add(gw, remote_toml([first.url]))
    assert infer(proc, BODY, HEADERS).json()["parameters"]["upstream"] == first.port
    (proc.models / "front" / "model.toml").write_text(remote_toml([second.url]))

    def moved() -> bool:
        answer = infer(proc, BODY, HEADERS)
        assert answer.status_code == 200, answer.text  # never a failed request
        return bool(answer.json()["parameters"]["upstream"] == second.port)

    wait_until(moved, 30, "requests to reach the second upstream")
    assert endpoints(proc).keys() == {second.url}


def test_503_is_retried_and_passed_on_when_every_endpoint_says_it(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    busy, good = start_upstreams(upstreams, 2)
    busy.mode = "busy"
    proc = add(gw, remote_toml([busy.url, good.url], remote_extra=QUIET))
    statuses = [infer(proc, BODY, HEADERS).status_code for _ in range(20)]
    assert statuses == [200] * 20
    assert len(good.received) == 20
    good.mode = "busy"
    response = infer(proc, BODY, HEADERS)
    assert response.status_code == 503
    assert "upstream busy" in response.json()["error"]
    assert response.headers["retry-after"] == "2"


def test_five_consecutive_5xx_eject_an_endpoint(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    bad, good = start_upstreams(upstreams, 2)
    bad.mode = "fail"
    proc = add(gw, remote_toml([bad.url, good.url], remote_extra=QUIET))
    # The balancer picks between the two at random: send until the bad one has had five
    # (expected within about ten requests; 200 allows for any run of bad luck).
    statuses: list[int] = []
    while len(bad.received) < 5 and len(statuses) < 200:
        statuses.append(infer(proc, BODY, HEADERS).status_code)
    # 500s are answers, not retried: each of the five the bad one got is seen.
    assert statuses.count(500) == 5
    after = [infer(proc, BODY, HEADERS).status_code for _ in range(20)]
    assert after == [200] * 20  # ejected: nothing more reaches the bad one
    assert len(bad.received) == 5
    state = endpoints(proc)
    assert state[bad.url]["ejected"] is True
    assert state[bad.url]["ejections"] == 1
    assert state[good.url]["ejected"] is False
    assert metric(proc, "infergate_remote_ejections_total", endpoint=bad.url) == 1
    assert metric(proc, "infergate_remote_endpoint_ejected", endpoint=bad.url) == 1
    assert metric(proc, "infergate_remote_endpoint_ejected", endpoint=good.url) == 0
    assert metric(proc, "infergate_remote_attempts_total", endpoint=bad.url) == 5


def test_load_checks_the_remote_metadata(gw: ServerProcess, upstreams: list[Upstream]) -> None:
    one, other, elsewhere = start_upstreams(upstreams, 3)
    other.outputs = [{"name": "z", "datatype": "INT64", "shape": [-1, 1]}]
    elsewhere.model = "another-model"  # answers, but not for remote-mlp: 404
    declared = '[[inputs]]\nname = "x"\ndatatype = "FP64"\nshape = [-1, 4]\n'
    dead = f"http://127.0.0.1:{free_port()}"
    proc = add(
        gw,
        {
            "good": remote_toml([one.url, dead]),
            "declared": remote_toml([one.url]).replace("[remote]", declared + "[remote]"),
            "disagree": remote_toml([one.url, other.url]),
            "nowhere": remote_toml([dead, elsewhere.url]),
        },
    )
    assert proc.model("good")["state"] == "ready"  # one endpoint down is not a failure
    assert endpoints(proc, "good")[dead]["healthy"] is False
    reasons = {n: proc.model(n) for n in ("declared", "disagree", "nowhere")}
    assert {n: r["state"] for n, r in reasons.items()} == dict.fromkeys(reasons, "failed")
    assert "differ from model.toml's (x FP64 [-1, 4])" in reasons["declared"]["reason"]
    assert "endpoints disagree" in reasons["disagree"]["reason"]
    assert f"no endpoint serves 'remote-mlp': {dead}" in reasons["nowhere"]["reason"]
    assert f"{elsewhere.url}: /v2/models/remote-mlp answered 404" in reasons["nowhere"]["reason"]
    response = infer(proc, BODY, HEADERS, model="nowhere")
    assert response.status_code == 424


def deploy_and_wait_for_retries(
    gw: ServerProcess, name: str, upstream: Upstream, said: str
) -> None:
    """Deploy remote model `name` on `upstream` (renamed into place), and wait until its
    load asks again, its reason saying `said`."""
    incoming = gw.models.parent / "incoming" / name
    incoming.mkdir(parents=True)
    (incoming / "model.toml").write_text(remote_toml([upstream.url]))
    os.replace(incoming, gw.models / name)

    def retrying() -> bool:
        status = status_or_none(gw, name)
        reason = (status or {}).get("reason") or ""
        return status is not None and said in reason and "asking again" in reason

    wait_until(retrying, 30, f"{name}'s load to wait for its upstream")


def test_an_upstream_that_starts_after_the_gateway_is_asked_again_until_it_answers(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    """Started together (compose, Kubernetes), the gateway may load a remote model before
    its upstream listens: while no endpoint answers at all, the load asks again (after 1,
    2 and 4 s) for up to 10 s, instead of failing the model at once."""
    late = Upstream()  # its port chosen, nothing listening on it yet
    deploy_and_wait_for_retries(gw, "late", late, "no endpoint serves it yet; asking again")
    assert gw.model("late")["state"] == "loading"
    upstreams.append(late.start())
    wait_until(lambda: gw.model("late")["state"] == "ready", 30, "the load to find it")
    assert gw.model("late")["reason"] is None  # the wait is over: it says so no more
    assert infer(gw, BODY, HEADERS, model="late").status_code == 200


def test_an_upstream_still_loading_its_models_is_asked_again_until_it_serves(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    """An upstream that is up but still loading its models answers 503 ("loading, retry
    shortly"), the usual case when both start together: the model failed at once."""
    starting = Upstream(loading=True).start()
    upstreams.append(starting)
    deploy_and_wait_for_retries(gw, "starting", starting, "answered 503")
    starting.loading = False
    wait_until(lambda: gw.model("starting")["state"] == "ready", 30, "the load to find it")
    assert infer(gw, BODY, HEADERS, model="starting").status_code == 200


def test_a_load_waits_for_an_endpoint_that_never_answers_at_most_seconds(
    gw: ServerProcess,
) -> None:
    """An endpoint that takes the connection and never answers, with a health_timeout_s
    of an hour: each of the load's requests waited that long, and the load held the
    gateway's readiness past 75 s. A request waits at most 5 s: the model fails with the
    endpoint's reason, the gateway ready again, well within a minute."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepted by the kernel, never answered
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        add(gw, {"silent": remote_toml([url], remote_extra="health_timeout_s = 3600")})
        assert gw.model("silent")["state"] == "failed"
        assert time.monotonic() - started < 45
        assert "no whole answer within 5 s" in str(gw.model("silent")["reason"])


def test_tenant_limits_and_breakers_apply(gw: ServerProcess, upstreams: list[Upstream]) -> None:
    good, bad = start_upstreams(upstreams, 2)
    bad.mode = "fail"
    toml = {"front": remote_toml([good.url]), "flaky": remote_toml([bad.url], remote_extra=QUIET)}
    proc = add(gw, toml)
    limited = {**HEADERS, "X-API-Key": LIMITED_KEY}
    statuses = [infer(proc, BODY, limited).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]  # burst 2, then the tenant's rate
    assert len(good.received) == 2
    # flaky's breaker (the profile's [breaker.models.flaky]) opens on its upstream's 500s.
    for _ in range(4):
        assert infer(proc, BODY, HEADERS, model="flaky").status_code == 500

    def opened() -> bool:
        return infer(proc, BODY, HEADERS, model="flaky").status_code == 503

    wait_until(opened, 10, "the breaker to open")
    sent = len(bad.received)
    response = infer(proc, BODY, HEADERS, model="flaky")
    assert response.status_code == 503
    assert "circuit breaker" in response.json()["error"]
    assert len(bad.received) == sent  # refused here, never sent upstream


def test_model_timeout_bounds_the_upstream_call(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    (slow,) = start_upstreams(upstreams, 1)
    slow.delay_s = 30
    proc = add(gw, remote_toml([slow.url], extra="timeout_ms = 300"))
    response = infer(proc, BODY, HEADERS)
    assert response.status_code == 504
    assert "did not answer within the model's timeout" in response.json()["error"]


def test_a_request_whose_client_left_is_cancelled_upstream(
    gw: ServerProcess, upstreams: list[Upstream]
) -> None:
    """A client that leaves while its request waits on the upstream: the upstream call is
    cancelled (its connection closed, not handed to another request mid-answer), so the
    request no longer holds a connection and a place in flight until the upstream answers
    (30 s here), and the next request goes through."""
    (slow,) = start_upstreams(upstreams, 1)
    slow.delay_s = 30
    proc = add(gw, remote_toml([slow.url], extra="timeout_ms = 60000"))
    head = (
        f"POST /v2/models/front/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(BODY)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
        + "\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", proc.port)) as sock:
        sock.sendall(head + BODY)
        wait_until(lambda: len(slow.received) == 1, 10, "the upstream to get the request")
        assert endpoints(proc)[slow.url]["in_flight"] == 1
    wait_until(lambda: endpoints(proc)[slow.url]["in_flight"] == 0, 10, "the call's end")
    slow.delay_s = 0
    assert infer(proc, BODY, HEADERS).status_code == 200


def shm_round_trip(proc: ServerProcess) -> None:
    """Inputs in this machine's shared memory cannot pass through: the gateway reads them,
    and sends them upstream as binary tensors."""
    key = f"/remote_{uuid.uuid4().hex[:8]}"
    region = shm.create_shared_memory_region("remote_in", key, 16)
    c = httpclient.InferenceServerClient(proc.url.removeprefix("http://"))
    try:
        x = np.array([[1.5, 2.5, 3.5, 4.5]], dtype=np.float32)
        shm.set_shared_memory_region(region, [x])
        c.register_system_shared_memory("remote_in", key, 16)
        given = httpclient.InferInput("x", [1, 4], "FP32")
        given.set_shared_memory("remote_in", 16)
        result = c.infer("front", [given], outputs=[httpclient.InferRequestedOutput("y")])
        np.testing.assert_array_equal(result.as_numpy("y"), x)
    finally:
        c.unregister_system_shared_memory()
        c.close()
        shm.destroy_shared_memory_region(region)


@pytest.mark.serial  # health latency against a wall clock: run alone
def test_health_answers_quickly_while_a_40_mb_json_body_goes_upstream(
    tmp_path: Path, upstreams: list[Upstream]
) -> None:
    """A JSON body bound for a remote model goes upstream unchanged, but its fields other
    than the tensors (parameters) are read: parsed on the event loop, JSON numbers held
    every other request (60 MB: 0.74 s; the 40 MB here, 0.5 s). The body
    decoder's helper reads them, and the body is written upstream as it came, without a
    copy on the loop."""
    (upstream,) = start_upstreams(upstreams, 1)
    models = tmp_path / "models"
    (models / "front").mkdir(parents=True)
    (models / "front" / "model.toml").write_text(remote_toml([upstream.url]))
    profile = write_profile(tmp_path, "[server]\nmax_request_mb = 64\n")
    server = ServerProcess(models, profile, tmp_path / "log").start()
    try:
        body, body_headers = big_json_body(40)
        reply, during = upload_while_probing(
            server.url, server.port, "/v2/models/front/infer", body, body_headers, tmp_path
        )
        assert reply is not None
        assert reply.status == 200, reply
        assert [r.sha256 for r in upstream.received] == [hashlib.sha256(body).hexdigest()]
        slow = slow_answers(during)
        assert not slow, f"health answers of 100 ms or more (s after the upload, took s): {slow}"
        assert len(during) >= 5, len(during)
    finally:
        server.stop()
