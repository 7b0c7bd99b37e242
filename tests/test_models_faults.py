"""Faults are survived, not remembered: a real server and real workers, with the faults
made real too (the server's own fd and file-size limits lowered while it runs)."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.conftest import write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("faults")
    models = root / "models"
    make_scripted(models / "script" / "1" / "model.scripted", controls=("crash",))
    # A model of its own for the start-failure test: a worker's restart backoff doubles
    # with each crash (up to 10 s), and script's has doubled four times in the fd test.
    make_scripted(models / "starter" / "1" / "model.scripted", controls=("crash",))
    make_scripted(models / "wide" / "1" / "model.scripted", controls=(), width=-1, outputs=("y",))
    # The arena test's own: its arena must not have grown already (the reply test grows wide's).
    make_scripted(models / "arena" / "1" / "model.scripted", controls=(), width=-1, outputs=("y",))
    profile = write_profile(root, "[server]\nmax_request_mb = 64\n")
    proc = ServerProcess(models, profile, root / "server.log").start()
    yield proc
    proc.stop()


def pid_of(server: ServerProcess) -> int:
    assert server.process is not None
    return server.process.pid


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def crash(client: httpx.Client, server: ServerProcess) -> None:
    before = server.worker_pids("script")
    body = scripted_inputs(crash=1)
    assert client.post(f"{server.url}/v2/models/script/infer", json=body).status_code == 503
    wait_for(
        lambda: (
            server.model("script")["state"] == "ready"
            and server.worker_pids("script") not in ([], before)
        ),
        "a new worker",
    )


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_no_fd_is_left_per_worker_restart(server: ServerProcess) -> None:
    pid = pid_of(server)
    with httpx.Client(timeout=30) as client:
        crash(client, server)  # the first restart sets up what stays (threads, buffers)
        baseline = open_fds(pid)
        # Three restarts: the restart backoff doubles from 0.25 s with each (a fourth would
        # wait 4 s), and a leak of one fd a restart already shows.
        for _ in range(3):
            crash(client, server)
        assert open_fds(pid) - baseline < 2  # was 2 more per restart until a GC


def test_a_worker_that_cannot_start_is_retried_and_health_says_so(
    server: ServerProcess,
) -> None:
    pid = pid_of(server)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    with httpx.Client(timeout=30) as client:  # its connection is opened before the limit
        assert client.get(f"{server.url}/v2/health/ready").status_code == 200
        crash_body = scripted_inputs(crash=1)
        limit = open_fds(pid) - 2  # the dead worker's fds come back, a new one needs more
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
        try:
            response = client.post(f"{server.url}/v2/models/starter/infer", json=crash_body)
            assert response.status_code == 503
            ready = wait_for(
                lambda: (r := client.get(f"{server.url}/v2/health/ready")).status_code == 503 and r,
                "ready to say 503",
            )
            assert "could not start a worker process" in ready.json()["error"]
            model = client.get(f"{server.url}/admin/models/starter").json()
            assert any(e["kind"] == "worker_start_failed" for e in model["events"])
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        # The shortage is over: the next retry starts it, and everything is ready again.
        wait_for(
            lambda: client.get(f"{server.url}/v2/health/ready").status_code == 200, "ready again"
        )
        wait_for(lambda: server.model("starter")["state"] == "ready", "the model to be ready")
        ok = client.post(f"{server.url}/v2/models/starter/infer", json=scripted_inputs(crash=0))
        assert ok.status_code == 200


def binary_infer(
    client: httpx.Client, server: ServerProcess, floats: int, model: str = "wide"
) -> httpx.Response:
    x = np.arange(floats, dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, floats],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    )
    return client.post(
        f"{server.url}/v2/models/{model}/infer",
        content=header + x.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )


def test_a_refused_arena_growth_is_a_503_and_the_worker_serves_on(
    server: ServerProcess,
) -> None:
    pid = pid_of(server)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    with httpx.Client(timeout=60) as client:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (4 << 20, hard))  # shm segments too
        try:
            refused = binary_infer(client, server, 2 << 20, "arena")  # 8 MB: it must grow
            assert refused.status_code == 503, refused.text
            assert "shared memory" in refused.json()["error"]
            for _ in range(3):
                assert binary_infer(client, server, 1000, "arena").status_code == 200
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


def test_replies_of_any_size_arrive(server: ServerProcess) -> None:
    pids = server.worker_pids("wide")
    with httpx.Client(timeout=120) as client:
        for floats in (6 << 20, 6 << 20, 1000):  # 24 MB: inline on the pipe, then the arena
            response = binary_infer(client, server, floats)
            assert response.status_code == 200, response.text
            header_len = int(response.headers["Inference-Header-Content-Length"])
            y = np.frombuffer(response.content[header_len:], dtype=np.float32)
            assert y.shape == (floats,)
            assert y[-1] == floats - 1
    assert server.worker_pids("wide") == pids  # no worker was taken for dead
