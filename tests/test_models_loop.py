"""Nothing on the event loop waits for a process or a disk: health answers fast while
many models reload and workers are killed, and only so many workers load at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.conftest import write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

MODELS = 10
LIMIT = 2


def spawned_workers(server_pid: int) -> int:
    children = psutil.Process(server_pid).children()
    count = 0
    for child in children:
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                count += 1
        except psutil.Error:
            continue
    return count


def test_health_stays_fast_while_models_reload_and_workers_die(tmp_path: Path) -> None:
    models = tmp_path / "models"
    files = [
        make_scripted(models / f"m{i}" / "1" / "model.scripted", controls=("crash",), load_ms=300)
        for i in range(MODELS)
    ]
    profile = write_profile(
        tmp_path, f"[server]\nfile_stable_s = 0.1\nmax_concurrent_loads = {LIMIT}\n"
    )
    server = ServerProcess(models, profile, tmp_path / "server.log").start()
    assert server.process is not None
    pid = server.process.pid
    latencies: list[float] = []
    most_workers = 0
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                started = time.perf_counter()
                assert client.get(f"{server.url}/v2/health/live").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        for path in files:  # every model gets a new file: ten reloads
            path.write_text(path.read_text() + "# new\n")
        for i in range(0, MODELS, 2):  # and half the serving workers die meanwhile
            body = scripted_inputs(crash=1)
            httpx.post(f"{server.url}/v2/models/m{i}/infer", json=body, timeout=30)
        deadline = time.monotonic() + 120
        while True:
            most_workers = max(most_workers, spawned_workers(pid))
            states = {server.model(f"m{i}")["state"] for i in range(MODELS)}
            events = [e for i in range(MODELS) for e in server.model(f"m{i}")["events"]]
            reloaded = sum(e["kind"] == "model_ready" for e in events)
            if states == {"ready"} and reloaded >= 2 * MODELS:
                break
            assert time.monotonic() < deadline, (states, reloaded)
            time.sleep(0.05)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        stop.set()
        prober.join()
        server.stop()
    assert len(latencies) > 20
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
    # Serving workers plus at most LIMIT loading ones (restarts take a slot too).
    assert most_workers <= MODELS + LIMIT
    assert "infergate_event_loop_lag_seconds" in metrics
