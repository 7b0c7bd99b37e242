"""The test suite's scripted runtime, through a real server and real workers: what a
request asks for is what the worker does, whatever the speed of this machine."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.engine.runtimes import runtime_names
from tests.conftest import write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


@pytest.fixture
def scripted_server(tmp_path: Path) -> Iterator[ServerProcess]:
    models = tmp_path / "models"
    make_scripted(
        models / "script" / "1" / "model.scripted",
        controls=("sleep_ms", "fail", "hold"),
        gate_dir=tmp_path / "gates",
    )
    (tmp_path / "gates").mkdir()
    proc = ServerProcess(models, write_profile(tmp_path), tmp_path / "server.log")
    yield proc.start()
    proc.stop()


def infer(server: ServerProcess, timeout: float = 30, **controls: int) -> httpx.Response:
    body = scripted_inputs(rows=2, **{"sleep_ms": 0, "fail": 0, "hold": 0, **controls})
    return httpx.post(f"{server.url}/v2/models/script/infer", json=body, timeout=timeout)


def test_registered_for_tests_only() -> None:
    assert "scripted" in runtime_names()  # conftest named the plugin


def test_the_input_sets_what_the_worker_does(
    scripted_server: ServerProcess, tmp_path: Path
) -> None:
    ok = infer(scripted_server)
    assert ok.status_code == 200, ok.text
    outputs = {o["name"]: o["data"] for o in ok.json()["outputs"]}
    assert outputs["y"] == [float(i) for i in range(8)]
    assert outputs["pid"] == scripted_server.worker_pids("script") * 2
    assert outputs["rows"] == [2, 2]

    failed = infer(scripted_server, fail=1)
    assert failed.status_code == 500
    assert "scripted failure" in failed.json()["error"]

    # A held request finishes only once the test releases it.
    held: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: held.append(infer(scripted_server, hold=7)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert held == []  # still held: the worker waits for its gate, not for a clock
    (tmp_path / "gates" / "release-7").touch()
    waiter.join(timeout=30)
    assert held[0].status_code == 200
