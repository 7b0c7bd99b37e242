"""Worker processes die, hang and come back; the gateway and the other models do not notice
beyond a clear error for the requests that were on the dead worker. The models are
scripted: a call holds until the test releases it, so "still running" never depends on how
fast this machine is (the same rules on the FakeClock: test_timing_rules.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import write_profile
from tests.onnx_models import make_mlp
from tests.polling import process_gone, wait_until
from tests.scripted_runtime import holding, make_scripted, scripted_inputs
from tests.server import ServerProcess
from tests.worker_calls import Background, instance_pid

# The scripted models: instances, and the execution timeout in ms.
WORKER_MODELS = {"pair": (2, 60_000), "solo": (1, 60_000), "hang": (1, 1_000)}


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for this module: scripted models whose calls hold until the test releases
    them (gate files in `gates`, a number per test), in two instances (pair), in one (solo),
    and in one with a 1 s execution timeout (hang); and an MLP (onnxruntime)."""
    root = tmp_path_factory.mktemp("workers")
    models, gates = root / "models", root / "gates"
    gates.mkdir()
    for name, (instances, timeout_ms) in WORKER_MODELS.items():
        make_scripted(models / name / "1" / "model.scripted", ("hold",), gate_dir=gates)
        (models / name / "model.toml").write_text(
            f"timeout_ms = {timeout_ms}\ninstances = {instances}\n"
        )
    make_mlp(models / "mlp" / "1" / "model.onnx")
    proc = ServerProcess(models, write_profile(root), root / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture
def worker_server(shared_server: ServerProcess) -> ServerProcess:
    """The shared server once every worker a test before killed is back."""
    wait_until(partial(all_ready, shared_server), what="every worker to be ready")
    return shared_server


def all_ready(server: ServerProcess) -> bool:
    return all(
        i["state"] == "ready" and i["pid"]
        for name in WORKER_MODELS
        for i in server.model(name)["versions"][0]["instances"]
    )


def mlp_request() -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


def gates(server: ServerProcess) -> Path:
    return server.models.parent / "gates"


def held_by(server: ServerProcess, gate: int, count: int = 1) -> list[int]:
    """The pids of the first `count` workers to hold a call at `gate`, once they have."""
    return wait_until(
        lambda: (pids := holding(gates(server), gate)) and len(pids) >= count and pids,
        what=f"{count} worker(s) to hold gate {gate}",
    )


def release(server: ServerProcess, gate: int) -> None:
    (gates(server) / f"release-{gate}").touch()


def test_workers_are_separate_processes_and_gateway_imports_no_runtime(
    worker_server: ServerProcess,
) -> None:
    assert worker_server.process is not None
    gateway = psutil.Process(worker_server.process.pid)
    children = {c.pid for c in gateway.children(recursive=True)}
    names = ("pair", "solo", "hang", "mlp")
    pids = [p for m in names for p in worker_server.worker_pids(m)]
    assert len(set(pids)) == 5
    assert set(pids) <= children
    # Each CPU worker runs on its share of the cores, with as many threads.
    for name in names:
        for instance in worker_server.model(name)["versions"][0]["instances"]:
            assert psutil.Process(instance["pid"]).cpu_affinity() == instance["cpus"]
            assert len(instance["cpus"]) == instance["threads"]
            # ...and nicer than the gateway ([devices] worker_nice, 10 by default), so the
            # gateway's event loop goes first on a busy CPU.
            assert psutil.Process(instance["pid"]).nice() == gateway.nice() + 10
    # The gateway process has not loaded onnxruntime: no model code runs in it.
    assert not any("onnxruntime" in m.path for m in gateway.memory_maps())


def test_sigkill_mid_request_fails_fast_and_the_worker_restarts(
    worker_server: ServerProcess,
) -> None:
    url = f"{worker_server.url}/v2/models/solo/infer"
    old = instance_pid(worker_server, "solo", 0)
    restarts = worker_server.model("solo")["versions"][0]["instances"][0]["restarts"]
    hanging = Background(url, scripted_inputs(hold=1))  # runs until released (never)
    assert held_by(worker_server, 1) == [old]
    loads = gates(worker_server) / "hold-loads"
    loads.touch()  # the restart waits until we have looked
    try:
        os.kill(old, signal.SIGKILL)
        response = hanging.result()
        assert response.status_code == 503  # not the 60 s execution timeout's 504
        assert "killed by signal 9" in response.json()["error"]
        assert response.headers["Retry-After"] == "1"
        # Ready tells the truth while the worker restarts; the other models keep serving.
        assert httpx.get(f"{worker_server.url}/v2/models/solo/ready").status_code == 503
        mlp = httpx.post(f"{worker_server.url}/v2/models/mlp/infer", json=mlp_request())
        assert mlp.status_code == 200
    finally:
        loads.unlink()
    model = worker_server.wait_model_state("solo", "ready")
    instance = model["versions"][0]["instances"][0]
    assert instance["restarts"] == restarts + 1
    assert instance["pid"] != old
    answer = httpx.post(url, json=scripted_inputs(hold=0))
    assert answer.json()["outputs"][1]["data"] == [instance["pid"]]


def test_a_request_on_a_killed_worker_is_retried_on_a_sibling(
    worker_server: ServerProcess,
) -> None:
    running = Background(f"{worker_server.url}/v2/models/pair/infer", scripted_inputs(hold=2))
    [first] = held_by(worker_server, 2)
    os.kill(first, signal.SIGKILL)  # mid-call: it holds until released
    # Retried on the sibling, which holds it in turn (without a retry: a 503 here).
    wait_until(
        lambda: len(holding(gates(worker_server), 2)) == 2 or running.done(),
        what="the retry to reach the sibling",
    )
    assert not running.done(), running.result().text
    [second] = [p for p in holding(gates(worker_server), 2) if p != first]
    release(worker_server, 2)
    response = running.result()
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
    assert outputs["pid"] == [second]  # the sibling answered
    assert outputs["y"] == [0.0, 1.0, 2.0, 3.0]


def test_a_hung_worker_is_killed_at_the_execution_timeout(worker_server: ServerProcess) -> None:
    url = f"{worker_server.url}/v2/models/hang/infer"
    old = instance_pid(worker_server, "hang", 0)
    hanging = Background(url, scripted_inputs(hold=3))
    held_by(worker_server, 3)
    # Meanwhile the gateway answers health, metadata and other models.
    for _ in range(5):
        assert httpx.get(f"{worker_server.url}/v2/health/live", timeout=10).status_code == 200
        assert (
            httpx.post(
                f"{worker_server.url}/v2/models/mlp/infer", json=mlp_request(), timeout=10
            ).status_code
            == 200
        )
    response = hanging.result()
    assert response.status_code == 504
    assert "did not answer within 1000 ms" in response.json()["error"]
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(old).wait(timeout=10)  # killed and reaped; raises if it lingers

    def restarted() -> bool:
        # The gateway learns of the exit from its pidfd a moment after the reaping: until
        # then the model still shows the old worker as ready.
        model = worker_server.model("hang")
        return model["state"] == "ready" and model["versions"][0]["instances"][0]["pid"] not in (
            None,
            old,
        )

    wait_until(restarted, what="a new worker for the hung one")
    release(worker_server, 3)  # the new worker may run a held call again
    answer = httpx.post(url, json=scripted_inputs(hold=3))
    assert answer.status_code == 200


def test_a_client_timeout_bounds_only_its_queue_wait(worker_server: ServerProcess) -> None:
    """As in Triton: `timeout` (microseconds, as tritonclient sends it) is how long the
    request may wait to start. Once it runs, only the model's timeout_ms bounds it."""
    old = instance_pid(worker_server, "hang", 0)
    body = scripted_inputs(hold=5)  # held for good: only the model's 1 s timeout ends it
    body["parameters"] = {"timeout": 300_000}
    response = httpx.post(f"{worker_server.url}/v2/models/hang/infer", json=body, timeout=30)
    assert response.status_code == 504, response.text
    assert "did not answer within 1000 ms" in response.json()["error"]
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(old).wait(timeout=10)


def test_the_workers_of_a_gateway_killed_by_sigkill_exit_even_mid_call(tmp_path: Path) -> None:
    """No worker outlives its gateway: not an idle one, nor one stuck in a model call, which
    would otherwise keep its CPU and memory (a GPU's, in production) until the call ends."""
    models, gates = tmp_path / "models", tmp_path / "gates"
    gates.mkdir()
    make_scripted(models / "busy" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    make_scripted(models / "idle" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    server = ServerProcess(models, write_profile(tmp_path), tmp_path / "server.log").start()
    assert server.process is not None
    try:
        idle = server.worker_pids("idle")
        url = f"{server.url}/v2/models/busy/infer"

        def call() -> None:  # held until released: never, here; the gateway dies under it
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(url, json=scripted_inputs(hold=1), timeout=60)

        caller = threading.Thread(target=call)
        caller.start()
        busy = wait_until(lambda: holding(gates, 1), what="the call to be held")
        os.kill(server.process.pid, signal.SIGKILL)  # the gateway alone, not its group
        server.process.wait()
        wait_until(lambda: all(process_gone(p) for p in idle + busy), what="the workers to exit")
        caller.join(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)  # whatever is left of the group
