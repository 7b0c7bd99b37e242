"""Prometheus metrics after real traffic, and the event stream as things happen."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from tests.conftest import BAD_REQUEST
from tests.polling import wait_until
from tests.scrape import metric
from tests.scripted_runtime import make_scripted
from tests.server import ServerProcess
from tests.test_reload import place


class EventReader:
    """Reads /admin/events (server-sent events) in a thread, on a plain socket: close()
    shuts the socket down, which ends a blocked read at once (closing an httpx stream from
    another thread does not, and the server then waits out its shutdown grace period)."""

    def __init__(self, url: str) -> None:
        self.events: list[dict[str, Any]] = []
        self.connected = threading.Event()
        parts = urlsplit(url)
        self._sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
        self._sock.sendall(f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError), self._sock.makefile("rb") as stream:
            for line in stream:  # chunked framing lines are skipped: they are not data
                self.connected.set()
                if line.startswith(b"data: "):
                    self.events.append(orjson.loads(line[6:]))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        assert not self._thread.is_alive(), "the event reader did not stop"
        self._sock.close()

    def kinds(self, model: str) -> list[str]:
        return [e["kind"] for e in self.events if e["model"] == model]


def fails_fast(server: ServerProcess, body: dict[str, Any]) -> bool:
    """One request to flaky; True once its breaker answers 503."""
    return httpx.post(f"{server.url}/v2/models/flaky/infer", json=body).status_code == 503


def test_events_stream_a_reload_and_a_breaker_trip(breaker_server: ServerProcess) -> None:
    reader = EventReader(f"{breaker_server.url}/admin/events")
    assert reader.connected.wait(10)
    place(
        breaker_server.models / "mlp" / "1" / "model.scripted",
        partial(make_scripted, controls=(), load_ms=1),
    )
    wait_until(lambda: "model_ready" in reader.kinds("mlp"), what="the reload event")
    assert reader.kinds("mlp")[:2] == ["model_loading", "model_ready"]
    bad = BAD_REQUEST
    wait_until(lambda: fails_fast(breaker_server, bad), what="the breaker to open")
    wait_until(lambda: "breaker_open" in reader.kinds("flaky"), what="the breaker event")
    opened = next(e for e in reader.events if e["kind"] == "breaker_open")
    assert "failure rate" in opened["message"]
    reader.close()


def test_a_scrape_after_traffic(breaker_server: ServerProcess) -> None:
    ok = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    for _ in range(20):
        assert httpx.post(f"{breaker_server.url}/v2/models/mlp/infer", json=ok).status_code == 200
    bad = BAD_REQUEST
    wait_until(lambda: fails_fast(breaker_server, bad), what="the breaker to open")
    pid = breaker_server.worker_pids("mlp")[0]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: breaker_server.worker_pids("mlp") not in ([], [pid]), what="the restart")
    m = breaker_server
    assert metric(m, "infergate_requests_total", model="mlp", tenant="default", status="200") == 20
    assert metric(m, "infergate_requests_total", model="flaky", status="500") >= 4
    assert metric(m, "infergate_requests_total", model="flaky", status="503") >= 1
    assert metric(m, "infergate_queue_seconds_count", model="mlp") == 20
    assert 0 < metric(m, "infergate_compute_seconds_sum", model="mlp") < 20
    assert metric(m, "infergate_batch_size_count", model="mlp") >= 1
    assert metric(m, "infergate_breaker_state", model="flaky", version="1") == 2
    assert metric(m, "infergate_model_reloads_total", model="mlp", outcome="ready") == 1
    assert metric(m, "infergate_worker_restarts_total", model="mlp") == 1
    assert 0 <= metric(m, "infergate_device_utilization_percent") <= 100
    assert metric(m, "infergate_device_memory_used_bytes") > 100 * 2**20
    wait_until(
        lambda: metric(m, "infergate_worker_memory_bytes", model="mlp") > 10 * 2**20,
        what="the new worker's memory",
    )


def test_every_served_version_has_a_breaker_state_series(server: ServerProcess) -> None:
    assert metric(server, "infergate_breaker_state", model="mlp", version="2") == 0  # closed
