"""The remote runtime end to end: a real `infergate serve` in front of upstreams on
loopback (another infergate, and tests/remote_upstream.py whose failures the test sets)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from infergate.client import encode_infer_request
from tests.conftest import write_profile
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


def gateway(tmp_path: Path, toml: str | dict[str, str], profile: str = "") -> ServerProcess:
    """A gateway serving `toml` as model `front` (or each model named in a dict)."""
    models = tmp_path / "gw-models"
    for name, text in ({"front": toml} if isinstance(toml, str) else toml).items():
        (models / name).mkdir(parents=True)
        (models / name / "model.toml").write_text(text)
    folder = tmp_path / "gw"
    folder.mkdir()
    return ServerProcess(models, write_profile(folder, profile), folder / "server.log")


@pytest.fixture
def upstreams() -> Iterator[list[Upstream]]:
    started: list[Upstream] = []
    yield started
    for upstream in started:
        upstream.stop()


def start_upstreams(started: list[Upstream], count: int) -> list[Upstream]:
    for _ in range(count):
        started.append(Upstream().start())
    return started


@pytest.fixture
def front(tmp_path: Path, upstreams: list[Upstream]) -> Iterator[ServerProcess]:
    """A gateway whose model `front` is remote-mlp on one recording upstream."""
    (upstream,) = start_upstreams(upstreams, 1)
    proc = gateway(tmp_path, remote_toml([upstream.url])).start()
    wait_until(lambda: proc.model("front")["state"] == "ready", 30, "front to load")
    yield proc
    proc.stop()


def infer(
    server: ServerProcess, body: bytes, headers: dict[str, str], model: str = "front"
) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer", content=body, headers=headers, timeout=30
    )


BODY, HEADERS = encode_infer_request({"x": X}, ["y"])
QUIET = "health_interval_s = 600"  # no active checks: what the test sees is the traffic's


def started(proc: ServerProcess, *names: str) -> ServerProcess:
    proc.start()
    for name in names or ("front",):

        def loaded(name: str = name) -> bool:
            return bool(proc.model(name)["state"] != "loading")

        wait_until(loaded, 30, f"{name} to load")
    return proc


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
    tmp_path: Path, upstreams: list[Upstream]
) -> None:
    sick, good = start_upstreams(upstreams, 2)
    checks = "health_interval_s = 0.1\nunhealthy_threshold = 2"
    proc = started(gateway(tmp_path, remote_toml([sick.url, good.url], remote_extra=checks)))
    try:
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
    finally:
        proc.stop()


def test_metadata_and_results_come_from_another_infergate(
    tmp_path: Path, upstreams: list[Upstream]
) -> None:
    models = tmp_path / "up-models"
    make_scripted(models / "remote-mlp" / "1" / "model.scripted", ())
    (tmp_path / "up").mkdir()
    back = ServerProcess(models, write_profile(tmp_path / "up"), tmp_path / "up" / "log")
    back.start()
    try:
        wait_until(lambda: back.model("remote-mlp")["state"] == "ready", 60, "upstream")
        proc = gateway(tmp_path, remote_toml([back.url], remote_extra="version = 1")).start()
        try:
            wait_until(lambda: proc.model("front")["state"] == "ready", 30, "front to load")
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
            proc.stop()
    finally:
        back.stop()


def test_connection_failures_are_retried_on_another_endpoint(
    tmp_path: Path, upstreams: list[Upstream]
) -> None:
    gone, good = start_upstreams(upstreams, 2)
    proc = started(gateway(tmp_path, remote_toml([gone.url, good.url], remote_extra=QUIET)))
    try:
        gone.stop()  # after the load: its port now refuses connections
        upstreams.remove(gone)
        statuses = [infer(proc, BODY, HEADERS).status_code for _ in range(20)]
        assert statuses == [200] * 20
        assert len(good.received) == 20
        refused = metric(proc, "infergate_remote_attempts_total", outcome="connect_failed")
        assert metric(proc, "infergate_remote_retries_total", why="connect_failed") == refused
        assert 1 <= refused <= 5  # then outlier detection ejects it
    finally:
        proc.stop()


def test_editing_model_toml_moves_the_model_to_other_endpoints(
    tmp_path: Path, upstreams: list[Upstream]
) -> None:
    first, second = start_upstreams(upstreams, 2)
    proc = started(gateway(tmp_path, remote_toml([first.url])))
    try:
        assert infer(proc, BODY, HEADERS).json()["parameters"]["upstream"] == first.port
        (proc.models / "front" / "model.toml").write_text(remote_toml([second.url]))

        def moved() -> bool:
            answer = infer(proc, BODY, HEADERS)
            assert answer.status_code == 200, answer.text  # never a failed request
            return bool(answer.json()["parameters"]["upstream"] == second.port)

        wait_until(moved, 30, "requests to reach the second upstream")
        assert endpoints(proc).keys() == {second.url}
    finally:
        proc.stop()


def test_503_is_retried_and_passed_on_when_every_endpoint_says_it(
    tmp_path: Path, upstreams: list[Upstream]
) -> None:
    busy, good = start_upstreams(upstreams, 2)
    busy.mode = "busy"
    proc = started(gateway(tmp_path, remote_toml([busy.url, good.url], remote_extra=QUIET)))
    try:
        statuses = [infer(proc, BODY, HEADERS).status_code for _ in range(20)]
        assert statuses == [200] * 20
        assert len(good.received) == 20
        good.mode = "busy"
        response = infer(proc, BODY, HEADERS)
        assert response.status_code == 503
        assert "upstream busy" in response.json()["error"]
        assert response.headers["retry-after"] == "2"
    finally:
        proc.stop()


def test_five_consecutive_5xx_eject_an_endpoint(tmp_path: Path, upstreams: list[Upstream]) -> None:
    bad, good = start_upstreams(upstreams, 2)
    bad.mode = "fail"
    proc = started(gateway(tmp_path, remote_toml([bad.url, good.url], remote_extra=QUIET)))
    try:
        statuses = [infer(proc, BODY, HEADERS).status_code for _ in range(40)]
        # 500s are answers, not retried: each of the first five the bad one got is seen.
        assert statuses.count(500) == 5
        assert len(bad.received) == 5
        assert statuses[-10:] == [200] * 10
        state = endpoints(proc)
        assert state[bad.url]["ejected"] is True
        assert state[bad.url]["ejections"] == 1
        assert state[good.url]["ejected"] is False
        assert metric(proc, "infergate_remote_ejections_total", endpoint=bad.url) == 1
        assert metric(proc, "infergate_remote_endpoint_ejected", endpoint=bad.url) == 1
        assert metric(proc, "infergate_remote_endpoint_ejected", endpoint=good.url) == 0
        assert metric(proc, "infergate_remote_attempts_total", endpoint=bad.url) == 5
    finally:
        proc.stop()


def test_load_checks_the_remote_metadata(tmp_path: Path, upstreams: list[Upstream]) -> None:
    one, other = start_upstreams(upstreams, 2)
    other.outputs = [{"name": "z", "datatype": "INT64", "shape": [-1, 1]}]
    declared = '[[inputs]]\nname = "x"\ndatatype = "FP64"\nshape = [-1, 4]\n'
    dead = f"http://127.0.0.1:{free_port()}"
    proc = started(
        gateway(
            tmp_path,
            {
                "good": remote_toml([one.url, dead]),
                "declared": remote_toml([one.url]).replace("[remote]", declared + "[remote]"),
                "disagree": remote_toml([one.url, other.url]),
                "nowhere": remote_toml([dead]),
            },
        ),
        "good",
        "declared",
        "disagree",
        "nowhere",
    )
    try:
        assert proc.model("good")["state"] == "ready"  # one endpoint down is not a failure
        assert endpoints(proc, "good")[dead]["healthy"] is False
        reasons = {n: proc.model(n) for n in ("declared", "disagree", "nowhere")}
        assert {n: r["state"] for n, r in reasons.items()} == dict.fromkeys(reasons, "failed")
        assert "differ from model.toml's (x FP64 [-1, 4])" in reasons["declared"]["reason"]
        assert "endpoints disagree" in reasons["disagree"]["reason"]
        assert f"no endpoint serves 'remote-mlp': {dead}" in reasons["nowhere"]["reason"]
        response = infer(proc, BODY, HEADERS, model="nowhere")
        assert response.status_code == 424
    finally:
        proc.stop()


LIMITS_PROFILE = """
[server]
max_request_mb = 1
[breaker]
window_seconds = 2
failure_rate = 0.5
min_requests = 4
consecutive_windows = 1
backoff_initial_s = 30
[tenants.default]
rps = 0.01
burst = 2
"""


def test_tenant_limits_and_breakers_apply(tmp_path: Path, upstreams: list[Upstream]) -> None:
    good, bad = start_upstreams(upstreams, 2)
    bad.mode = "fail"
    toml = {"front": remote_toml([good.url]), "flaky": remote_toml([bad.url], remote_extra=QUIET)}
    proc = started(gateway(tmp_path, toml, LIMITS_PROFILE), "front", "flaky")
    try:
        statuses = [infer(proc, BODY, HEADERS).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]  # burst 2, then the tenant's rate
        assert len(good.received) == 2
    finally:
        proc.stop()
    breaker_profile = LIMITS_PROFILE.replace("rps = 0.01\nburst = 2\n", "")
    proc = started(gateway(tmp_path / "b", toml, breaker_profile), "front", "flaky")
    try:
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
    finally:
        proc.stop()


def test_model_timeout_bounds_the_upstream_call(tmp_path: Path, upstreams: list[Upstream]) -> None:
    (slow,) = start_upstreams(upstreams, 1)
    slow.delay_s = 30
    proc = started(gateway(tmp_path, remote_toml([slow.url], extra="timeout_ms = 300")))
    try:
        response = infer(proc, BODY, HEADERS)
        assert response.status_code == 504
        assert "did not answer within the model's timeout" in response.json()["error"]
    finally:
        proc.stop()


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
