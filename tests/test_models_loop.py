"""Nothing on the event loop waits for a process or a disk: health answers fast while
many models reload and workers are killed, and only so many workers load at once."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import write_profile
from tests.health_probe import HealthProbe
from tests.polling import wait_until
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

# Health latency is measured against a wall clock: run alone, in the serial pass.
pytestmark = pytest.mark.serial

MODELS = 10
LIMIT = 2


def durations(answers: list[tuple[float, float]]) -> list[float]:
    return [end - start for start, end in answers]


def spawned_workers(server_pid: int) -> int:
    """Model workers: named ig-worker, children of the gateway's fork server."""
    count = 0
    for child in psutil.Process(server_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            count += child.name() == "ig-worker"
    return count


def test_health_stays_fast_while_models_reload_and_workers_die(tmp_path: Path) -> None:
    models = tmp_path / "models"
    gates = tmp_path / "gates"
    # Loads take 300 ms from the reloads on: the first ones, at start, are not what is
    # measured, and ten of them two at a time would add a second and a half to the start.
    scripted = partial(make_scripted, controls=("crash",), gate_dir=gates, mark_loads=True)
    files = [scripted(models / f"m{i}" / "1" / "model.scripted") for i in range(MODELS)]
    profile = write_profile(
        tmp_path, f"[server]\nfile_stable_s = 0.1\nmax_concurrent_loads = {LIMIT}\n"
    )
    server = ServerProcess(models, profile, tmp_path / "server.log").start()
    most_loading = 0
    prober = HealthProbe(server.url, tmp_path, pause_s=0.02)
    try:
        for path in files:  # every model gets a new file: ten reloads
            scripted(path, load_ms=300)
        for i in range(0, MODELS, 2):  # and half the serving workers die meanwhile
            body = scripted_inputs(crash=1)
            httpx.post(f"{server.url}/v2/models/m{i}/infer", json=body, timeout=30)
        deadline = time.monotonic() + 120
        while True:
            # Loads under way, as the workers mark them (a retiring worker, still alive
            # while it drains, is neither loading nor serving: counting processes raced it).
            most_loading = max(most_loading, len(list(gates.glob("loading-*"))))
            states = {server.model(f"m{i}")["state"] for i in range(MODELS)}
            events = [e for i in range(MODELS) for e in server.model(f"m{i}")["events"]]
            reloaded = sum(e["kind"] == "model_ready" for e in events)
            if states == {"ready"} and reloaded >= 2 * MODELS:
                break
            assert time.monotonic() < deadline, (states, reloaded)
            time.sleep(0.05)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        try:
            latencies = durations(prober.stop())
        finally:
            server.stop()
    assert len(latencies) > 20
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
    # At most LIMIT loads at once, and restarts one more (load_slots.py); and loads were
    # seen (300 ms each).
    assert 1 <= most_loading <= LIMIT + 1
    assert "infergate_event_loop_lag_seconds" in metrics


def test_health_answers_fast_with_two_hundred_models_loading(tmp_path: Path) -> None:
    models = tmp_path / "models"
    gates = tmp_path / "gates"
    gates.mkdir()
    (gates / "hold-loads").touch()  # every load waits until the test lets them go
    for i in range(200):
        make_scripted(models / f"m{i:03}" / "1" / "model.scripted", controls=(), gate_dir=gates)
    profile = write_profile(tmp_path, f"[server]\nmax_concurrent_loads = {LIMIT}\n")
    server = ServerProcess(models, profile, tmp_path / "server.log")
    with server.log.open("ab") as log:
        server.process = subprocess.Popen(
            [sys.executable, "-m", "infergate", "serve", "--models", str(models)]
            + ["--profile", str(profile), "--port", str(server.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pid = server.process.pid
    most_loading = 0
    latencies: list[float] = []
    try:
        with httpx.Client(timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:  # up, not ready: the models are loading
                assert time.monotonic() < deadline, server.log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{server.url}/v2/health/live").status_code == 200:
                        break
                time.sleep(0.05)
            with HealthProbe(server.url, tmp_path, pause_s=0.02) as prober:
                # No load can finish while they are held: every worker alive is loading.
                wait_until(lambda: spawned_workers(pid) >= LIMIT, what=f"{LIMIT} loaders")
                for _ in range(20):  # a second for a third worker to show up, if one would
                    most_loading = max(most_loading, spawned_workers(pid))
                    time.sleep(0.05)
                (gates / "hold-loads").unlink()
                loaded = 0
                while loaded < 6:  # a few loads' worth of time, 194 models still waiting
                    index = client.post(f"{server.url}/v2/repository/index").json()
                    loaded = sum(m.get("state") == "READY" for m in index)
                    time.sleep(0.05)
                latencies = durations(prober.stop())
            assert client.get(f"{server.url}/v2/health/ready").status_code == 503
            # A 404 names the first 20 models and counts the rest, not 200 names.
            unknown = client.get(f"{server.url}/v2/models/m2000").json()["error"]
            twenty = ", ".join(f"m{i:03}" for i in range(20))
            assert f"served models: {twenty} and 180 more. Hint:" in unknown, unknown
    finally:
        started = time.monotonic()
        server.stop()
        stop_s = time.monotonic() - started
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
    assert most_loading <= LIMIT
    assert stop_s < 15  # 194 waiting loads do not hold up the shutdown
