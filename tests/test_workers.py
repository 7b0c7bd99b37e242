"""Worker processes die, hang and come back; the gateway and the other models do not notice
beyond a clear error for the requests that were on the dead worker."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import httpx
import psutil

from tests.server import ServerProcess


def loop_request(n: int) -> dict[str, Any]:
    return {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [n]}]}


def mlp_request() -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


class Background:
    """One request in a thread, timed."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.response: httpx.Response | None = None
        self.elapsed = 0.0
        self._thread = threading.Thread(target=self._run, args=(url, body))
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        started = time.monotonic()
        self.response = httpx.post(url, json=body, timeout=30)
        self.elapsed = time.monotonic() - started

    def result(self) -> httpx.Response:
        self._thread.join(30)
        assert self.response is not None
        return self.response


def instance_pid(server: ServerProcess, model: str, index: int) -> int:
    instances = server.model(model)["versions"][0]["instances"]
    pid = instances[index]["pid"]
    assert pid is not None
    return int(pid)


def test_workers_are_separate_processes_and_gateway_imports_no_runtime(
    slow_server: ServerProcess,
) -> None:
    assert slow_server.process is not None
    gateway = psutil.Process(slow_server.process.pid)
    children = {c.pid for c in gateway.children(recursive=True)}
    pids = [p for m in ("loop", "solo", "mlp") for p in slow_server.worker_pids(m)]
    assert len(set(pids)) == 4
    assert set(pids) <= children
    # Each CPU worker runs on its share of the cores, with as many threads.
    for name in ("loop", "solo", "mlp"):
        for instance in slow_server.model(name)["versions"][0]["instances"]:
            assert psutil.Process(instance["pid"]).cpu_affinity() == instance["cpus"]
            assert len(instance["cpus"]) == instance["threads"]
            # ...and nicer than the gateway ([devices] worker_nice, 10 by default), so the
            # gateway's event loop goes first on a busy CPU.
            assert psutil.Process(instance["pid"]).nice() == gateway.nice() + 10
    # The gateway process has not loaded onnxruntime: no model code runs in it.
    assert not any("onnxruntime" in m.path for m in gateway.memory_maps())


def test_sigkill_mid_request_fails_fast_and_the_worker_restarts(
    slow_server: ServerProcess,
) -> None:
    url = f"{slow_server.url}/v2/models/solo/infer"
    old = instance_pid(slow_server, "solo", 0)
    hanging = Background(url, loop_request(10**9))  # would run for half an hour
    time.sleep(0.3)  # let it reach the worker (a real process; no clock to inject)
    os.kill(old, signal.SIGKILL)
    response = hanging.result()
    assert response.status_code == 503
    assert "killed by signal 9" in response.json()["error"]
    assert response.headers["Retry-After"] == "1"
    assert hanging.elapsed < 1.4  # well before the 1.5 s execution timeout
    # Ready tells the truth while the worker restarts; the other models keep serving.
    assert httpx.get(f"{slow_server.url}/v2/models/solo/ready").status_code == 503
    assert (
        httpx.post(f"{slow_server.url}/v2/models/mlp/infer", json=mlp_request()).status_code == 200
    )
    model = slow_server.wait_model_state("solo", "ready")
    instance = model["versions"][0]["instances"][0]
    assert instance["restarts"] == 1
    assert instance["pid"] != old
    assert httpx.post(url, json=loop_request(5)).json()["outputs"][0]["data"] == [5.0]


def test_a_request_on_a_killed_worker_is_retried_on_a_sibling(
    slow_server: ServerProcess,
) -> None:
    url = f"{slow_server.url}/v2/models/loop/infer"
    running = Background(url, loop_request(200_000))  # about 0.4 s of work, well inside 1.5 s
    time.sleep(0.1)
    os.kill(instance_pid(slow_server, "loop", 0), signal.SIGKILL)
    response = running.result()
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [200_000.0]


def test_a_hung_worker_is_killed_at_the_execution_timeout(slow_server: ServerProcess) -> None:
    url = f"{slow_server.url}/v2/models/loop/infer"
    old = instance_pid(slow_server, "loop", 0)
    hanging = Background(url, loop_request(10**9))
    # Meanwhile the gateway answers health, metadata and other models at once.
    for _ in range(5):
        assert httpx.get(f"{slow_server.url}/v2/health/live", timeout=1).status_code == 200
        assert (
            httpx.post(
                f"{slow_server.url}/v2/models/mlp/infer", json=mlp_request(), timeout=1
            ).status_code
            == 200
        )
    response = hanging.result()
    assert response.status_code == 504
    assert "did not answer within 1500 ms" in response.json()["error"]
    assert 1.4 < hanging.elapsed < 5
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(old).wait(timeout=10)  # killed and reaped; raises if it lingers
    slow_server.wait_model_state("loop", "ready")
    assert httpx.post(url, json=loop_request(3)).json()["outputs"][0]["data"] == [3.0]


def test_a_client_timeout_bounds_only_its_queue_wait(slow_server: ServerProcess) -> None:
    """As in Triton: `timeout` (microseconds, as tritonclient sends it) is how long the
    request may wait to start. Once it runs, only the model's timeout_ms bounds it."""
    body = loop_request(10**9)
    body["parameters"] = {"timeout": 300_000}
    response = httpx.post(f"{slow_server.url}/v2/models/loop/infer", json=body, timeout=30)
    assert response.status_code == 504
    assert "did not answer within 1500 ms" in response.json()["error"]
