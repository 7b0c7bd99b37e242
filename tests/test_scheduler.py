"""The scheduler end to end on a real server: batching merges concurrent requests and
gives each caller its own rows; deadlines give 504 without running; a full queue gives 503
with Retry-After and sheds lower classes first; realtime requests keep their deadline under
a saturating batch-class load. A busy worker is a scripted call held until the test
releases it, never CPU work; the same rules on the FakeClock: test_timing_rules.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.conftest import write_profile
from tests.onnx_models import make_mlp
from tests.polling import wait_until
from tests.scrape import metric
from tests.scripted_runtime import holding, make_scripted, scripted_inputs
from tests.server import ServerProcess

PROFILE = """
[server]
[batching]
max_batch_size = 8
max_queue_delay_ms = 20
[tenants.default]
class = "realtime"
rps = 1000000
burst = 1000000
max_concurrency = 1000
"""


@pytest.fixture(scope="module")
def sched_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("sched")
    models = root / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    gates = root / "gates"
    gates.mkdir()
    for name in ("held", "gated"):  # hold: a call runs until the test releases it
        make_scripted(models / name / "1" / "model.scripted", ("hold",), gate_dir=gates)
    make_scripted(models / "multi" / "1" / "model.scripted", ())
    (models / "multi" / "model.toml").write_text("instances = 3\n")
    make_mlp(models / "unbatched" / "1" / "model.onnx")
    (models / "unbatched" / "model.toml").write_text("[batching]\nmax_batch_size = 0\n")
    (models / "held" / "model.toml").write_text(
        "timeout_ms = 60000\n[batching]\nmax_queue_size = 2\n"
    )
    (models / "gated" / "model.toml").write_text("timeout_ms = 60000\n")
    proc = ServerProcess(models, write_profile(root, PROFILE), root / "server.log").start()
    yield proc
    proc.stop()


def mlp_body(x: np.ndarray, priority: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [
            {
                "name": "x",
                "datatype": "FP32",
                "shape": list(x.shape),
                "data": x.reshape(-1).tolist(),
            }
        ]
    }
    if priority is not None:
        body["parameters"] = {"priority": priority}
    return body


def held_body(hold: int = 0, priority: Any = None) -> dict[str, Any]:
    body = scripted_inputs(hold=hold)
    if priority is not None:
        body["parameters"] = {"priority": priority}
    return body


def gates(server: ServerProcess) -> Path:
    return server.models.parent / "gates"


def hold_worker(server: ServerProcess, model: str, gate: int) -> threading.Thread:
    """Occupy `model`'s only instance with a call held at `gate` until release()."""
    url = f"{server.url}/v2/models/{model}/infer"
    holder = threading.Thread(target=lambda: httpx.post(url, json=held_body(gate), timeout=60))
    holder.start()
    wait_until(lambda: holding(gates(server), gate), what=f"{model}'s worker to hold the call")
    return holder


def release(server: ServerProcess, gate: int) -> None:
    (gates(server) / f"release-{gate}").touch()


def queued(server: ServerProcess, model: str) -> float:
    # The gauge is set per class with jobs waiting: no series for the model, none waits.
    return metric(server, "infergate_queue_depth", absent=0.0, model=model)


def run_parallel(calls: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    results: list[httpx.Response | None] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def go(i: int, url: str, body: dict[str, Any]) -> None:
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            results[i] = http.post(url, json=body)

    threads = [threading.Thread(target=go, args=(i, *c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def assert_each_got_its_own_rows(
    server: ServerProcess, model: str, inputs: list[np.ndarray], responses: list[httpx.Response]
) -> None:
    """Every caller got the model's output for its own input, whole."""
    session = ort.InferenceSession(str(server.models / model / "1" / "model.onnx"))
    for x, response in zip(inputs, responses, strict=True):
        assert response.status_code == 200, response.text
        out = response.json()["outputs"][0]
        expected = session.run(None, {"x": x})[0]
        assert out["shape"] == list(expected.shape)
        got = np.array(out["data"], np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_concurrent_requests_are_merged_and_split_back(sched_server: ServerProcess) -> None:
    url = f"{sched_server.url}/v2/models/gated/infer"
    batches_before = metric(sched_server, "infergate_batch_size_count", absent=0.0, model="gated")
    holder = hold_worker(sched_server, "gated", 1)  # the only worker is busy: work queues up
    rows = [1 + i % 3 for i in range(16)]
    # Batch class: 30 s to start (the default tenant here is realtime: 50 ms).
    batch = {"priority": "batch"}
    bodies = [{**scripted_inputs(rows=n, hold=0), "parameters": batch} for n in rows]
    for i, body in enumerate(bodies):  # each caller's x is its own
        body["inputs"][0]["data"] = [float(100 * i + j) for j in range(4 * rows[i])]
    results: list[httpx.Response] = []
    callers = [
        threading.Thread(target=lambda b=b: results.append(httpx.post(url, json=b, timeout=60)))
        for b in bodies
    ]
    for t in callers:
        t.start()
    wait_until(lambda: queued(sched_server, "gated") == len(bodies), what="all to queue")
    release(sched_server, 1)
    holder.join(60)
    for t in callers:
        t.join(60)
    assert len(results) == len(bodies)
    for response in results:
        assert response.status_code == 200, response.text
        out = {o["name"]: o for o in response.json()["outputs"]}
        first = out["y"]["data"][0]
        assert first % 100 == 0  # the caller's own x, whole, in order
        i = int(first // 100)
        assert out["y"]["data"] == bodies[i]["inputs"][0]["data"]
        assert out["y"]["shape"] == [rows[i], 4]
        assert out["rows"]["data"][0] <= 8  # max_batch_size
    batches = metric(sched_server, "infergate_batch_size_count", model="gated") - batches_before
    assert batches < len(bodies) + 1  # the held call, then the 16 in merged batches
    shared = [
        o["data"][0] > o["shape"][0]
        for r in results
        for o in r.json()["outputs"]
        if o["name"] == "rows"
    ]
    assert any(shared)  # some ran in a batch with others' rows


def test_with_batching_off_each_request_runs_alone_and_whole(
    sched_server: ServerProcess,
) -> None:
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(6)]
    batches_before = metric(
        sched_server, "infergate_batch_size_count", absent=0.0, model="unbatched"
    )
    url = f"{sched_server.url}/v2/models/unbatched/infer"
    # Batch class (30 s to start): six in a row on one worker may take longer than the
    # realtime 50 ms on a busy machine, and waiting is not what this test is about.
    responses = run_parallel([(url, mlp_body(x, "batch")) for x in inputs])
    assert_each_got_its_own_rows(sched_server, "unbatched", inputs, responses)
    assert all(r.json()["outputs"][0]["shape"] == [3, 3] for r in responses)
    batches = metric(sched_server, "infergate_batch_size_count", model="unbatched")
    assert batches - batches_before == len(inputs)


def test_a_large_request_runs_in_chunks_of_max_batch_size(sched_server: ServerProcess) -> None:
    x = np.random.default_rng(4).standard_normal((20, 4)).astype(np.float32)
    over_8 = metric(sched_server, "infergate_batch_size_count", absent=0.0, model="mlp") - metric(
        sched_server, "infergate_batch_size_bucket", absent=0.0, model="mlp", le="8.0"
    )
    response = httpx.post(f"{sched_server.url}/v2/models/mlp/infer", json=mlp_body(x))
    assert response.status_code == 200
    out = response.json()["outputs"][0]
    assert out["shape"] == [20, 3]
    session = ort.InferenceSession(str(sched_server.models / "mlp" / "1" / "model.onnx"))
    np.testing.assert_allclose(
        np.array(out["data"], np.float32).reshape(20, 3),
        session.run(None, {"x": x})[0],
        rtol=1e-5,
        atol=1e-6,
    )
    after = metric(sched_server, "infergate_batch_size_count", model="mlp") - metric(
        sched_server, "infergate_batch_size_bucket", model="mlp", le="8.0"
    )
    assert after == over_8  # no batch over 8 rows ran


def test_deadline_in_queue_gives_504_and_full_queue_503(sched_server: ServerProcess) -> None:
    url = f"{sched_server.url}/v2/models/held/infer"
    holder: list[httpx.Response] = []
    busy = threading.Thread(
        target=lambda: holder.append(httpx.post(url, json=held_body(2, "batch"), timeout=60))
    )
    busy.start()  # occupies held's only instance until released
    wait_until(lambda: holding(gates(sched_server), 2), what="the worker to hold the call")
    expired_before = metric(
        sched_server, "infergate_requests_shed_total", absent=0.0, model="held", reason="deadline"
    )
    late = httpx.post(url, json=held_body())  # realtime: 50 ms to start, and it cannot
    assert late.status_code == 504  # answered at its deadline: the holder is still held
    assert "waited" in late.json()["error"]
    assert "it was not run" in late.json()["error"]
    assert (
        metric(sched_server, "infergate_requests_shed_total", model="held", reason="deadline")
        == expired_before + 1
    )
    # Two batch-class requests fill the queue (max_queue_size = 2); a third is refused.
    waiting = [
        threading.Thread(
            target=lambda: holder.append(httpx.post(url, json=held_body(0, 3), timeout=60))
        )
        for _ in range(2)
    ]
    for t in waiting:
        t.start()
    wait_until(lambda: queued(sched_server, "held") == 2, what="two requests to queue")
    full = httpx.post(url, json=held_body(0, "batch"))
    assert full.status_code == 503
    assert full.headers["Retry-After"] == "1"
    assert "max_queue_size = 2" in full.json()["error"]
    # A realtime request sheds a batch-class one to get in (and then misses its 50 ms).
    urgent = httpx.post(url, json=held_body())
    assert urgent.status_code == 504
    wait_until(lambda: len(holder) == 1, what="the shed request's answer")
    release(sched_server, 2)
    busy.join(60)
    for t in waiting:
        t.join(60)
    codes = sorted(r.status_code for r in holder)
    assert codes == [200, 200, 503]  # the holder, one batch request, and the one shed
    shed = [r for r in holder if r.status_code == 503][0]
    assert "was shed to make room for a realtime one" in shed.json()["error"]


@pytest.mark.serial
def test_realtime_meets_its_deadline_under_a_batch_flood(sched_server: ServerProcess) -> None:
    """The realtime class's 50 ms queue deadline, met end to end beside a flood of batch
    requests: a latency against the wall clock, so it runs in the serial pass (the order
    the queue takes classes in is tested on the FakeClock in test_timing_rules.py)."""
    url = f"{sched_server.url}/v2/models/mlp/infer"
    stop = threading.Event()
    flood_codes: list[int] = []
    big = np.ones((64, 4), np.float32)  # 8 chunks of 8 rows each

    def flood() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                flood_codes.append(http.post(url, json=mlp_body(big, "batch")).status_code)

    flooders = [threading.Thread(target=flood) for _ in range(6)]
    for t in flooders:
        t.start()
    codes: list[int] = []
    try:
        wait_until(lambda: len(flood_codes) >= 6, what="the flood to start")
        with httpx.Client(timeout=60) as http:
            for _ in range(40):
                codes.append(http.post(url, json=mlp_body(np.ones((1, 4), np.float32))).status_code)
    finally:
        stop.set()
        for t in flooders:
            t.join()
    assert codes == [200] * 40  # none missed its 50 ms queue deadline
    assert len(flood_codes) > 10
    assert flood_codes.count(200) > 10


def test_a_session_sticks_to_one_instance(sched_server: ServerProcess) -> None:
    def batches() -> list[int]:
        model = sched_server.model("multi")
        return [i["batches"] for i in model["versions"][0]["instances"]]

    x = np.ones((1, 4), np.float32)
    used = set()
    for session in ("alice", "bob", "carol", "dave", "erin"):
        before = batches()
        body = mlp_body(x)
        body["parameters"] = {"session": session}
        for _ in range(6):
            response = httpx.post(f"{sched_server.url}/v2/models/multi/infer", json=body)
            assert response.status_code == 200
        grew = [b - a for a, b in zip(before, batches(), strict=True)]
        assert sorted(grew) == [0, 0, 6], (session, grew)  # all six on one instance
        used.add(grew.index(6))
    assert len(used) > 1  # and the sessions spread over the instances
