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


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    models = tmp_path / "models"
    make_scripted(models / "first" / "1" / "model.scripted", controls=())
    profile = write_profile(tmp_path, "[server]\nfile_stable_s = 0.1\n")
    proc = ServerProcess(models, profile, tmp_path / "server.log")
    yield proc.start()
    proc.stop()


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
    shutil.rmtree(server.models)
    wait_for(
        lambda: httpx.get(f"{server.url}/admin/models/first").status_code == 404,
        "the model to go",
    )
    make_scripted(server.models / "second" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "second"), "a model in the new folder to serve")
    make_scripted(server.models / "third" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "third"), "a model added after that to serve")


def test_a_watch_that_cannot_be_set_up_is_an_event_and_a_metric(server: ServerProcess) -> None:
    assert server.process is not None
    pid = server.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    with httpx.Client(timeout=30) as client:  # connected before the limit
        assert "infergate_repository_watching 1.0" in client.get(f"{server.url}/metrics").text
        with client.stream("GET", f"{server.url}/admin/events") as events:
            next(events.iter_lines())  # what streaming imports, imported while fds remain
        shutil.rmtree(server.models)
        wait_for(
            lambda: client.get(f"{server.url}/admin/models/first").status_code == 404,
            "the model to go",
        )
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
        assert "infergate_repository_watch_failures_total 3.0" in metrics
        make_scripted(server.models / "back" / "1" / "model.scripted", controls=())
        wait_for(lambda: serves(server, "back", client), "watching to resume")


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
