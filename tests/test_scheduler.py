"""The scheduler end to end on a real server: batching merges concurrent requests and
gives each caller its own rows; deadlines give 504 without running; a full queue gives 503
with Retry-After and sheds lower classes first; realtime requests keep their deadline under
a saturating batch-class load."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.conftest import write_profile
from tests.onnx_models import make_loop, make_mlp
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
    make_loop(models / "loop" / "1" / "model.onnx")
    make_mlp(models / "multi" / "1" / "model.onnx")
    (models / "multi" / "model.toml").write_text("instances = 3\n")
    make_mlp(models / "unbatched" / "1" / "model.onnx")
    (models / "unbatched" / "model.toml").write_text("[batching]\nmax_batch_size = 0\n")
    (models / "loop" / "model.toml").write_text(
        "timeout_ms = 20000\n[batching]\nmax_queue_size = 2\n"
    )
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


def loop_body(n: int, priority: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [n]}]
    }
    if priority is not None:
        body["parameters"] = {"priority": priority}
    return body


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    text = httpx.get(f"{server.url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


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


def test_concurrent_requests_are_merged_and_split_back(
    sched_server: ServerProcess, tmp_path: Path
) -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1 + i % 3, 4)).astype(np.float32) for i in range(16)]
    batches_before = metric(sched_server, "infergate_batch_size_count", model="mlp")
    url = f"{sched_server.url}/v2/models/mlp/infer"
    responses = run_parallel([(url, mlp_body(x)) for x in inputs])
    assert_each_got_its_own_rows(sched_server, "mlp", inputs, responses)
    batches = metric(sched_server, "infergate_batch_size_count", model="mlp") - batches_before
    assert batches < len(inputs)  # some requests shared a run


def test_with_batching_off_each_request_runs_alone_and_whole(
    sched_server: ServerProcess,
) -> None:
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(6)]
    batches_before = metric(sched_server, "infergate_batch_size_count", model="unbatched")
    url = f"{sched_server.url}/v2/models/unbatched/infer"
    responses = run_parallel([(url, mlp_body(x)) for x in inputs])
    assert_each_got_its_own_rows(sched_server, "unbatched", inputs, responses)
    assert all(r.json()["outputs"][0]["shape"] == [3, 3] for r in responses)
    batches = metric(sched_server, "infergate_batch_size_count", model="unbatched")
    assert batches - batches_before == len(inputs)


def test_a_large_request_runs_in_chunks_of_max_batch_size(sched_server: ServerProcess) -> None:
    x = np.random.default_rng(4).standard_normal((20, 4)).astype(np.float32)
    over_8 = metric(sched_server, "infergate_batch_size_count", model="mlp") - metric(
        sched_server, "infergate_batch_size_bucket", model="mlp", le="8.0"
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
    url = f"{sched_server.url}/v2/models/loop/infer"
    holder: list[httpx.Response] = []
    busy = threading.Thread(
        target=lambda: holder.append(httpx.post(url, json=loop_body(700_000, "batch"), timeout=60))
    )
    busy.start()  # occupies loop's only instance for about a second and a half
    time.sleep(0.2)
    expired_before = metric(
        sched_server, "infergate_requests_shed_total", model="loop", reason="deadline"
    )
    started = time.monotonic()
    late = httpx.post(url, json=loop_body(1))  # realtime: 50 ms to start, and it cannot
    assert late.status_code == 504
    assert "waited" in late.json()["error"]
    assert "it was not run" in late.json()["error"]
    assert time.monotonic() - started < 1.0  # answered at its deadline, not after the holder
    assert (
        metric(sched_server, "infergate_requests_shed_total", model="loop", reason="deadline")
        == expired_before + 1
    )
    # Two batch-class requests fill the queue (max_queue_size = 2); a third is refused.
    waiting = [
        threading.Thread(
            target=lambda: holder.append(httpx.post(url, json=loop_body(10, 3), timeout=60))
        )
        for _ in range(2)
    ]
    for t in waiting:
        t.start()
    time.sleep(0.2)
    full = httpx.post(url, json=loop_body(10, "batch"))
    assert full.status_code == 503
    assert full.headers["Retry-After"] == "1"
    assert "max_queue_size = 2" in full.json()["error"]
    # A realtime request sheds a batch-class one to get in (and then misses its 50 ms).
    urgent = httpx.post(url, json=loop_body(10))
    assert urgent.status_code == 504
    busy.join()
    for t in waiting:
        t.join()
    codes = sorted(r.status_code for r in holder)
    assert codes == [200, 200, 503]  # the holder, one batch request, and the one shed
    shed = [r for r in holder if r.status_code == 503][0]
    assert "was shed to make room for a realtime one" in shed.json()["error"]


def test_realtime_meets_its_deadline_under_a_batch_flood(sched_server: ServerProcess) -> None:
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
    latencies, codes = [], []
    try:
        time.sleep(0.3)
        with httpx.Client(timeout=60) as http:
            for _ in range(40):
                t0 = time.monotonic()
                codes.append(http.post(url, json=mlp_body(np.ones((1, 4), np.float32))).status_code)
                latencies.append(time.monotonic() - t0)
    finally:
        stop.set()
        for t in flooders:
            t.join()
    assert codes == [200] * 40  # none missed its 50 ms queue deadline
    assert len(flood_codes) > 10
    assert flood_codes.count(200) > 10
    assert sorted(latencies)[int(0.99 * len(latencies))] < 0.5


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
