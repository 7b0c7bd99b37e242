"""The watcher never dies: a real server watching a real folder through symlink loops,
a deleted and recreated models folder, and a watch that cannot be set up."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the file: a test that deletes its models folder waits until the
    server has seen that, and each adds models of its own names."""
    root = tmp_path_factory.mktemp("watcher")
    models = root / "models"
    make_scripted(models / "first" / "1" / "model.scripted", controls=())
    profile = write_profile(root, "[server]\nfile_stable_s = 0.1\n")
    proc = ServerProcess(models, profile, root / "server.log")
    yield proc.start()
    proc.stop()


def no_models(server: ServerProcess, client: httpx.Client | None = None) -> bool:
    get = client.get if client is not None else httpx.get
    return bool(get(f"{server.url}/admin/models", timeout=30).json() == [])


def serves(server: ServerProcess, name: str, client: httpx.Client | None = None) -> bool:
    body = scripted_inputs(rows=1)
    post = client.post if client is not None else httpx.post
    return post(f"{server.url}/v2/models/{name}/infer", json=body, timeout=30).status_code == 200


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_a_symlink_loop_is_skipped_and_later_models_still_load(server: ServerProcess) -> None:
    loopy = server.models / "loopy" / "1"
    loopy.mkdir(parents=True)
    os.symlink("model.scripted", loopy / "model.scripted")  # points at itself: ELOOP
    os.symlink(".", loopy / "again")  # a directory loop
    # The watcher looks at it, says so and goes on (before, that ended the watcher).
    wait_for(lambda: "cannot look at" in server.log.read_text(), "the watcher to skip it")
    make_scripted(server.models / "later" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "later"), "the later model to serve")


def test_a_deleted_and_recreated_models_folder_is_watched_again(server: ServerProcess) -> None:
    assert not no_models(server)
    shutil.rmtree(server.models)
    wait_for(lambda: no_models(server), "the models to go")
    make_scripted(server.models / "second" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "second"), "a model in the new folder to serve")
    make_scripted(server.models / "third" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "third"), "a model added after that to serve")


def test_a_watch_that_cannot_be_set_up_is_an_event_and_a_metric(server: ServerProcess) -> None:
    assert server.process is not None
    pid = server.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    with httpx.Client(timeout=30) as client:  # connected before the limit
        metrics = client.get(f"{server.url}/metrics").text
        assert "infergate_repository_watching 1.0" in metrics
        failed_before = watch_failures(metrics)
        with client.stream("GET", f"{server.url}/admin/events") as events:
            next(events.iter_lines())  # what streaming imports, imported while fds remain
        shutil.rmtree(server.models)
        wait_for(lambda: no_models(server, client), "the models to go")
        # Far below what is open: whatever closes meanwhile, no new fd for a watch.
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (8, hard))
        try:
            server.models.mkdir()  # a new folder, and no fd to watch it with
            with client.stream("GET", f"{server.url}/admin/events?replay=100") as events:
                for line in events.iter_lines():
                    if line.startswith("data:") and "watcher_failed" in line:
                        assert "cannot watch" in json.loads(line[5:])["message"]
                        break
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        # (Read after: /metrics opens /proc files.)
        metrics = client.get(f"{server.url}/metrics").text
        assert watch_failures(metrics) - failed_before == 3
        make_scripted(server.models / "back" / "1" / "model.scripted", controls=())
        wait_for(lambda: serves(server, "back", client), "watching to resume")


def watch_failures(metrics: str) -> float:
    name = "infergate_repository_watch_failures_total "
    (line,) = [x for x in metrics.splitlines() if x.startswith(name)]
    return float(line.removeprefix(name))


def test_doctor_says_whether_the_folder_can_be_watched(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "infergate", "doctor", "--models", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["watching"]["status"] == "ok", checks["watching"]
    assert str(tmp_path) in checks["watching"]["detail"]
