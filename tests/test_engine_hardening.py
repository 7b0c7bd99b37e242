"""Odd but legal requests are answered for their sender only, through a real server and
real (scripted) workers: a client's timeout bounds its queue wait and never kills a
worker; `outputs: []` and empty batches are answered; models without a batch dimension
never merge requests; a request the queue can never hold is a 400; a started request is
never expired; breakers judge the model, not the load; tenants of a class share the queue
fairly; rejections carry reason codes; and models that cannot serve say so with a 4xx."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from infergate.engine.admission.tenants import hash_key
from infergate.engine.engine import _no_version_error
from infergate.engine.lifecycle.registry import ModelRecord
from infergate.errors import ModelNotReady
from tests.polling import wait_until
from tests.scrape import metric
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

LIGHT, FLOOD, PIRATE, FROZEN = "light-key", "flood-key", "pirate-key", "frozen-key"

# `fast` is the default tenant's class, with a short deadline; `slow` is what a test asks
# for (parameters.priority) when it queues requests on purpose.
PROFILE = f"""
[classes.fast]
rank = 0
deadline_ms = 60
[classes.slow]
rank = 1
deadline_ms = 30000

[tenants.default]
class = "fast"
rps = 1000000
burst = 1000000
max_concurrency = 1000

[tenants.light]
class = "slow"
rps = 1000000
burst = 1000000
max_concurrency = 1000
api_keys = ["{hash_key(LIGHT)}"]

[tenants.flood]
class = "slow"
rps = 1000000
burst = 1000000
max_concurrency = 1000
api_keys = ["{hash_key(FLOOD)}"]

[tenants.pirate]
class = "slow"
max_concurrency = 1
api_keys = ["{hash_key(PIRATE)}"]

[tenants.frozen]
class = "slow"
rps = 0
burst = 1
api_keys = ["{hash_key(FROZEN)}"]
"""

FIXED = """
gate_dir = "{gates}"
[[inputs]]
name = "x"
datatype = "FP32"
shape = [1, 4]
[[inputs]]
name = "hold"
datatype = "INT64"
shape = [1, 1]
[[outputs]]
name = "rows"
datatype = "INT64"
shape = [1, 1]
"""


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gates")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gates: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("hardening")
    models = root / "models"

    def scripted(name: str, toml: str = "", **kwargs: Any) -> None:
        make_scripted(models / name / "1" / "model.scripted", gate_dir=gates, **kwargs)
        (models / name / "model.toml").write_text(toml)

    # One worker, batching off: one request runs at a time, in the order the queue picks.
    scripted("held", "[batching]\nmax_batch_size = 0\n", controls=("sleep_ms", "hold"))
    scripted("chunky", "[batching]\nmax_batch_size = 4\n", controls=("sleep_ms",))
    scripted("tiny", "[batching]\nmax_batch_size = 4\nmax_queue_size = 2\n")
    scripted(
        "shared",
        "[batching]\nmax_batch_size = 0\n[breaker]\nwindow_seconds = 1\nmin_requests = 4\n"
        "consecutive_windows = 2\nlatency_p99_ms = 250\nfailure_rate = 0.5\n",
        controls=("sleep_ms",),
    )
    scripted("twin", "instances = 2\n", controls=("crash",))
    scripted("spare")
    scripted("broken", load_fail="this model cannot load")
    (models / "fixed" / "1").mkdir(parents=True)
    (models / "fixed" / "1" / "model.scripted").write_text(FIXED.format(gates=gates))
    profile = root / "profile.toml"
    profile.write_text(PROFILE)
    proc = ServerProcess(models, profile, root / "server.log").start()
    yield proc
    proc.stop()


def post(
    server: ServerProcess, model: str, body: dict[str, Any], key: str | None = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer", json=body, headers=headers, timeout=60
    )


def slow_class(body: dict[str, Any], **parameters: Any) -> dict[str, Any]:
    return {**body, "parameters": {"priority": "slow", **parameters}}


def in_background(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    return thread, out


def queued(server: ServerProcess, model: str) -> float:
    return metric(server, "infergate_queue_depth", absent=0.0, model=model)


def running(server: ServerProcess, model: str) -> bool:
    """A request is on the worker: in flight, and none waiting."""
    version = server.model(model)["versions"][0]
    return bool(version["in_flight"] >= 1 and queued(server, model) == 0)


def release(gates: Path, gate: int) -> None:
    (gates / f"release-{gate}").touch()


def test_a_client_timeout_bounds_its_queue_wait_and_never_kills_a_worker(
    server: ServerProcess, gates: Path
) -> None:
    pids = server.worker_pids("held")
    # Alone, 1 µs is enough to start: it runs (today it killed the worker: 504).
    body = scripted_inputs(sleep_ms=30, hold=0)
    assert post(server, "held", {**body, "parameters": {"timeout": 1}}).status_code == 200
    # Behind a running request, 1 µs of queue wait runs out: 504, and nothing is killed.
    holder, answer = in_background(
        lambda: post(server, "held", scripted_inputs(sleep_ms=0, hold=1))
    )
    wait_until(lambda: running(server, "held"), what="the holder to run")
    late = post(server, "held", {**body, "parameters": {"timeout": 1}})
    assert late.status_code == 504
    assert "queue" in late.json()["error"]
    release(gates, 1)
    holder.join()
    assert answer[0].status_code == 200
    assert server.worker_pids("held") == pids
    assert metric(server, "infergate_worker_restarts_total", absent=0.0, model="held") == 0
    assert metric(server, "infergate_breaker_state", model="held") == 0


def test_empty_outputs_means_every_output(server: ServerProcess) -> None:
    response = post(server, "chunky", {**scripted_inputs(sleep_ms=0), "outputs": []})
    assert response.status_code == 200, response.text
    assert sorted(o["name"] for o in response.json()["outputs"]) == ["pid", "rows", "y"]
    # ...in the encoding the request asks for: every output as binary data here.
    body = {
        **scripted_inputs(sleep_ms=0),
        "outputs": [],
        "parameters": {"binary_data_output": True},
    }
    binary = post(server, "chunky", body)
    assert binary.status_code == 200, binary.text
    assert "inference-header-content-length" in binary.headers


def test_an_empty_batch_gets_empty_outputs(server: ServerProcess) -> None:
    body = scripted_inputs(rows=0, sleep_ms=0)
    response = post(server, "chunky", body)
    assert response.status_code == 200, response.text
    shapes = {o["name"]: o["shape"] for o in response.json()["outputs"]}
    assert shapes == {"y": [0, 4], "pid": [0, 1], "rows": [0, 1]}
    assert all(o["data"] == [] for o in response.json()["outputs"])
    # As tritonclient sends np.zeros((0, 4)): binary in, binary out.
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    inputs = [
        triton.InferInput("x", [0, 4], "FP32"),
        triton.InferInput("sleep_ms", [0, 1], "INT64"),
    ]
    inputs[0].set_data_from_numpy(np.zeros((0, 4), np.float32))
    inputs[1].set_data_from_numpy(np.zeros((0, 1), np.int64))
    result = client.infer("chunky", inputs)
    assert result.as_numpy("y").shape == (0, 4)
    assert result.as_numpy("rows").shape == (0, 1)


def test_a_model_without_a_batch_dimension_never_merges_requests(
    server: ServerProcess, gates: Path
) -> None:
    def one(gate: int) -> httpx.Response:
        body = {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                {"name": "hold", "datatype": "INT64", "shape": [1, 1], "data": [gate]},
            ],
            "parameters": {"priority": "slow"},
        }
        return post(server, "fixed", body)

    holder, first = in_background(lambda: one(2))
    wait_until(lambda: running(server, "fixed"), what="the holder to run")
    others = [in_background(lambda: one(0)) for _ in range(7)]
    wait_until(lambda: queued(server, "fixed") == 7, what="7 requests queued")
    release(gates, 2)
    for thread, _ in [(holder, first), *others]:
        thread.join()
    for response in [first[0], *(out[0] for _, out in others)]:
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [1]  # it ran in a batch of one


def test_a_request_larger_than_the_queue_can_hold_is_a_400(server: ServerProcess) -> None:
    response = post(
        server, "tiny", scripted_inputs(rows=9, sleep_ms=0)
    )  # 3 chunks of <= 4 rows; 2 fit
    assert response.status_code == 400
    assert "max_queue_size = 2" in response.json()["error"]
    assert "retry-after" not in response.headers
    assert post(server, "tiny", scripted_inputs(rows=8, sleep_ms=0)).status_code == 200


def test_a_started_request_is_never_expired_by_its_class_deadline(
    server: ServerProcess,
) -> None:
    # 5 chunks of 4 rows, 30 ms each, in a class whose deadline is 60 ms: its last chunks
    # wait longer than that, but the request started, so it runs to the end.
    response = post(server, "chunky", scripted_inputs(rows=20, sleep_ms=30))
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [20, 4]


def test_the_breaker_judges_the_model_not_the_queue(server: ServerProcess) -> None:
    """Twelve streams on one worker: each request waits ~0.5 s, past the breaker's 250 ms
    p99 and past its class's 60 ms deadline (504s), but the model answers in 40 ms."""
    stop = time.monotonic() + 2.5
    codes: list[int] = []

    def stream() -> None:
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < stop:
                url = f"{server.url}/v2/models/shared/infer"
                codes.append(http.post(url, json=scripted_inputs(sleep_ms=40)).status_code)

    threads = [threading.Thread(target=stream) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 504 in codes  # the load was real: requests expired in the queue
    assert 503 not in codes, codes  # and the breaker never opened on it
    assert metric(server, "infergate_breaker_state", model="shared") == 0
    assert post(server, "shared", scripted_inputs(sleep_ms=0)).status_code == 200


def test_tenants_of_a_class_share_the_queue_fairly(server: ServerProcess, gates: Path) -> None:
    """A flooder's 8 queued requests do not all go before a light tenant's one."""
    # Each request passes a gate of its own, the holder's closed and the others open: the
    # worker marks a gate as it takes the request, so the order read back is the worker's,
    # not the order in which the client's threads happen to wake up on a busy machine.
    holder_gate, light_gate, flood_gates = 3, 30, range(20, 28)
    who = {holder_gate: "holder", light_gate: "light", **{g: "flood" for g in flood_gates}}
    for gate in (light_gate, *flood_gates):
        release(gates, gate)
    statuses: list[int] = []

    def call(key: str, body: dict[str, Any]) -> None:
        statuses.append(post(server, "held", body, key).status_code)

    holder, _ = in_background(lambda: call(FLOOD, scripted_inputs(sleep_ms=0, hold=holder_gate)))
    wait_until(lambda: running(server, "held"), what="the holder to run")
    flood = [
        in_background(lambda g=gate: call(FLOOD, scripted_inputs(sleep_ms=20, hold=g)))
        for gate in flood_gates
    ]
    wait_until(lambda: queued(server, "held") == 8, what="the flood queued")
    light, _ = in_background(lambda: call(LIGHT, scripted_inputs(sleep_ms=20, hold=light_gate)))
    wait_until(lambda: queued(server, "held") == 9, what="the light request queued")
    release(gates, holder_gate)
    for thread, _ in [(holder, None), *flood, (light, None)]:
        thread.join()
    assert statuses == [200] * 10, statuses
    marks = sorted(
        (mark for gate in who for mark in gates.glob(f"holding-{gate}-*")),
        key=lambda mark: mark.stat().st_mtime_ns,
    )
    done = [who[int(mark.name.split("-")[1])] for mark in marks]
    assert done[0] == "holder"
    assert done.index("light") <= 2, done  # behind at most one flood request, not eight


def test_rejections_carry_a_reason_code_not_message_text(
    server: ServerProcess, gates: Path
) -> None:
    holder, answer = in_background(
        lambda: post(server, "held", scripted_inputs(sleep_ms=0, hold=4), PIRATE)
    )
    wait_until(lambda: running(server, "held"), what="the holder to run")
    refused = post(server, "held", scripted_inputs(sleep_ms=0, hold=0), PIRATE)
    assert refused.status_code == 429
    release(gates, 4)
    holder.join()
    assert answer[0].status_code == 200
    # "pirate" contains "rate": the reason comes from the exception, not its text.
    rejected = "infergate_rate_limited_total"
    assert metric(server, rejected, absent=0.0, tenant="pirate", reason="rate") == 0
    assert metric(server, rejected, tenant="pirate", reason="concurrency") == 1


def test_a_tenant_with_rps_0_gets_429_with_a_finite_retry_after(server: ServerProcess) -> None:
    assert (
        post(server, "spare", scripted_inputs(sleep_ms=0), FROZEN).status_code == 200
    )  # its burst
    refused = post(server, "spare", scripted_inputs(sleep_ms=0), FROZEN)
    assert refused.status_code == 429
    seconds = refused.headers["Retry-After"]
    assert seconds == "60"
    assert f"retry in {seconds} s" in refused.json()["error"]


def test_a_retry_on_a_sibling_is_counted(server: ServerProcess) -> None:
    response = post(server, "twin", scripted_inputs(crash=1))
    assert response.status_code == 503  # it crashed its worker, and the sibling's too
    assert metric(server, "infergate_retries_total", model="twin") == 1


def test_models_that_cannot_serve_are_4xx_without_retry_after(server: ServerProcess) -> None:
    broken = post(server, "broken", scripted_inputs())
    assert broken.status_code == 424
    assert "failed to load" in broken.json()["error"]
    assert "retry-after" not in broken.headers
    unknown = post(server, "nothing-here", scripted_inputs())
    assert unknown.status_code == 404
    assert "retry-after" not in unknown.headers
    assert httpx.post(f"{server.url}/v2/repository/models/spare/unload").status_code == 200
    unloaded = post(server, "spare", scripted_inputs(sleep_ms=0))
    assert unloaded.status_code == 404
    assert "retry-after" not in unloaded.headers
    assert "infergate model load spare" in unloaded.json()["error"]


def test_inputs_with_different_batch_sizes_are_a_400(server: ServerProcess) -> None:
    """A batched model's inputs carry the request's rows: a request whose inputs disagree
    (x of 2 rows, sleep_ms of 1) would be merged with others' requests and cut back apart
    by its first input's rows, handing one caller's rows to another."""
    body = scripted_inputs(rows=2)
    body["inputs"].append({"name": "sleep_ms", "datatype": "INT64", "shape": [1, 1], "data": [0]})
    answer = httpx.post(f"{server.url}/v2/models/chunky/infer", json=body, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"] == (
        "the inputs of model 'chunky' have different batch sizes (first dimensions): "
        "x [2, 4], sleep_ms [1, 1]. Hint: send the same number of rows in every input"
    )
    fine = httpx.post(
        f"{server.url}/v2/models/chunky/infer", json=scripted_inputs(rows=2, sleep_ms=0)
    )
    assert fine.status_code == 200


def test_a_model_loading_its_first_version_says_so_without_naming_no_version() -> None:
    """A model loading after a restart answered "is loading: no version on disk" (a remote
    gateway's operator read it as the files being gone); it says it is loading."""
    error = _no_version_error(ModelRecord("m", loading=True))
    assert isinstance(error, ModelNotReady)
    assert str(error) == "model 'm' is loading. Hint: retry shortly"
    assert "no version on disk" in str(_no_version_error(ModelRecord("m")))
