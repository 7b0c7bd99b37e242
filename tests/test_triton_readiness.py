"""`[server] strict_readiness`: off by default (one tenant's broken model must not take the
gateway out of its load balancer); on, as Triton's default, a failed model makes the server
not ready until it is fixed or removed."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from infergate.server.views import repository_index
from tests.conftest import write_profile
from tests.server import ServerProcess
from tests.triton_models import make_simple


@pytest.fixture
def strict_server(tmp_path: Path) -> Iterator[ServerProcess]:
    models = tmp_path / "models"
    make_simple(models / "simple" / "1" / "model.onnx")
    profile = write_profile(tmp_path, "[server]\nstrict_readiness = true\nfile_stable_s = 0.1\n")
    proc = ServerProcess(models, profile, tmp_path / "server.log").start()
    yield proc
    proc.stop()


def _wait_ready(server: ServerProcess, status: int) -> httpx.Response:
    deadline = time.monotonic() + 60
    while True:
        response = httpx.get(f"{server.url}/v2/health/ready")
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_only_strict_readiness_follows_failed_models(
    triton_server: ServerProcess, strict_server: ServerProcess
) -> None:
    assert triton_server.model("broken")["state"] == "failed"  # by default: still ready
    assert httpx.get(f"{triton_server.url}/v2/health/ready").status_code == 200
    broken = strict_server.models / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "1" / "model.onnx").write_bytes(b"not onnx")
    response = _wait_ready(strict_server, 503)
    assert response.status_code == 503
    assert "broken (failed)" in response.json()["error"]
    assert "strict_readiness" in response.json()["error"]
    shutil.rmtree(broken)
    assert _wait_ready(strict_server, 200).status_code == 200


def test_the_repository_index_speaks_only_tritons_states() -> None:
    """Clients switch on Triton's index states (READY, LOADING, UNAVAILABLE); a version
    whose workers are restarting, failed or stopped is UNAVAILABLE, its reason saying
    which (what a real gateway's views hold: only the fields the index reads)."""

    def version(number: int, state: str, reason: str | None) -> SimpleNamespace:
        return SimpleNamespace(version=number, state=state, ready=state == "ready", reason=reason)

    model = SimpleNamespace(
        name="m",
        versions=(
            version(1, "ready", None),
            version(2, "loading", None),
            version(3, "restarting", "worker exited with code -9"),
            version(4, "failed", None),
            version(5, "stopped", None),
        ),
        failures={6: "bad file"},
    )
    rows = repository_index([cast(Any, model)])
    assert [(r["version"], r["state"], r["reason"]) for r in rows] == [
        ("1", "READY", ""),
        ("2", "LOADING", ""),
        ("3", "UNAVAILABLE", "restarting: worker exited with code -9"),
        ("4", "UNAVAILABLE", "failed"),
        ("5", "UNAVAILABLE", "stopped"),
        ("6", "UNAVAILABLE", "bad file"),
    ]
