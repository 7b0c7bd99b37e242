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


def test_a_thread_never_sees_the_registry_half_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from infergate.engine import runtimes

    # A plugin whose import waits until told, so the second thread surely looks meanwhile.
    (tmp_path / "gate_plugin.py").write_text(
        "import threading\nimporting = threading.Event()\nproceed = threading.Event()\n"
    )
    (tmp_path / "slow_plugin.py").write_text(
        "from gate_plugin import importing, proceed\n"
        "from infergate.engine.runtimes import RuntimeKind, register\n"
        "importing.set()\n"
        "proceed.wait(10)\n"
        "register(RuntimeKind('slow', ('.slow',), 'slow', 'numpy', 'none', 'x:y'))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(runtimes.PLUGINS_ENV, "slow_plugin")
    monkeypatch.setattr(runtimes, "_plugins_loaded", False)
    monkeypatch.setattr(runtimes, "_kinds", dict(runtimes._kinds))
    import gate_plugin  # type: ignore[import-not-found]

    first = threading.Thread(target=runtimes.runtime_names)
    first.start()
    assert gate_plugin.importing.wait(10)
    seen: list[str | None] = []
    second = threading.Thread(target=lambda: seen.append(runtimes.runtime_for(Path("m.slow"))))
    second.start()
    second.join(0.5)  # with a lock it waits for the import; the bug answers at once
    gate_plugin.proceed.set()
    first.join(10)
    second.join(10)
    sys.modules.pop("slow_plugin", None)
    sys.modules.pop("gate_plugin", None)
    assert seen == ["slow"]
