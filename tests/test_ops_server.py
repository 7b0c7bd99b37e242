"""The server as a service, through a real `infergate serve` configured only by its
environment: JSON logs, warnings at WARNING, an access log line per request with its
request id (the client's or a new one, returned in X-Request-ID), and the end-to-end
duration histogram per model and tenant on /metrics."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infergate.cli.logs import JsonFormatter, TextFormatter
from tests.conftest import write_profile
from tests.onnx_models import make_mlp
from tests.polling import wait_until
from tests.server import free_port, wait_ready

BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


class EnvServer:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.profile = write_profile(folder)
        self.log = folder / "server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERGATE_")}
        env.update(
            INFERGATE_HOST="127.0.0.1",
            INFERGATE_PORT=str(self.port),
            INFERGATE_MODELS=str(folder / "models"),
            INFERGATE_PROFILE=str(self.profile),
            INFERGATE_LOG_LEVEL="warning",
        )
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "infergate", "serve", "--log-format", "json",
                 "--access-log"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self) -> EnvServer:
        wait_ready(self.url, self.process, self.log)
        return self

    def records(self) -> list[dict[str, Any]]:
        # Whole lines only: the server may be writing the last one as this reads.
        text = self.log.read_text()
        whole = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvServer]:
    folder = tmp_path_factory.mktemp("ops")
    make_mlp(folder / "models" / "mlp" / "1" / "model.onnx")
    server = EnvServer(folder)
    yield server.wait_ready()
    server.stop()


def wait_for(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        time.sleep(0.1)


def test_configured_by_environment_with_json_logs_at_warning(env_server: EnvServer) -> None:
    # INFERGATE_PORT and INFERGATE_MODELS: it serves mlp on that port.
    assert httpx.post(f"{env_server.url}/v2/models/mlp/infer", json=BODY).status_code == 200
    records = env_server.records()
    assert records, "JSON lines"
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    # INFERGATE_LOG_LEVEL=warning: no INFO from the engine (the model_ready event)...
    assert not [r for r in records if r["level"] == "INFO" and r["logger"] != "infergate.access"]
    # ...but a rejected profile edit is a WARNING, its kind a field of its own (it names
    # no model, and its message has no empty slot for one).
    good = env_server.profile.read_text()
    env_server.profile.write_text(good + "\n[tenants.bad]\nrps = 'fast'\n")
    try:
        wait_for(
            lambda: any(
                r["level"] == "WARNING" and r.get("event") == "profile_rejected"
                for r in env_server.records()
            )
        )
        [rejected] = [r for r in env_server.records() if r.get("event") == "profile_rejected"]
        assert rejected["model"] is None
        assert rejected["message"].startswith("profile_rejected: "), rejected
    finally:
        env_server.profile.write_text(good)


def test_access_log_and_request_ids(env_server: EnvServer) -> None:
    mine = httpx.post(
        f"{env_server.url}/v2/models/mlp/infer", json=BODY, headers={"X-Request-ID": "abc-123"}
    )
    assert mine.headers["x-request-id"] == "abc-123"
    made = httpx.post(f"{env_server.url}/v2/models/mlp/versions/1/infer", json=BODY)
    generated = made.headers["x-request-id"]
    assert len(generated) == 32
    missing = httpx.post(f"{env_server.url}/v2/models/nope/infer", json=BODY)
    assert missing.status_code == 404
    assert missing.headers["x-request-id"]
    # Routes other than infer (the Starlette app's) carry the id and log their status too.
    health = httpx.get(f"{env_server.url}/v2/models/nope", headers={"X-Request-ID": "h-1"})
    assert (health.status_code, health.headers["x-request-id"]) == (404, "h-1")

    def access(rid: str) -> dict[str, Any] | None:
        found = [r for r in env_server.records() if r.get("request_id") == rid]
        return found[0] if found else None

    wait_for(lambda: access(missing.headers["x-request-id"]) is not None)
    line = access("abc-123")
    assert line is not None
    assert line["logger"] == "infergate.access"
    assert line["level"] == "INFO"  # --access-log, whatever the level
    assert (line["model"], line["version"], line["tenant"], line["status"]) == (
        "mlp",
        "-",
        "default",
        200,
    )
    assert line["latency_ms"] > 0
    assert line["method"] == "POST"
    assert access(generated)["version"] == "1"  # type: ignore[index]
    assert access(missing.headers["x-request-id"])["status"] == 404  # type: ignore[index]
    wait_for(lambda: access("h-1") is not None)
    assert access("h-1")["status"] == 404  # type: ignore[index]


def test_duration_histogram_per_model_and_tenant(env_server: EnvServer) -> None:
    for _ in range(3):
        httpx.post(f"{env_server.url}/v2/models/mlp/infer", json=BODY)
    text = httpx.get(f"{env_server.url}/metrics").text
    count = [
        line
        for line in text.splitlines()
        if line.startswith("infergate_request_duration_seconds_count")
        and 'model="mlp"' in line
        and 'tenant="default"' in line
    ]
    assert count
    assert float(count[0].split()[-1]) >= 3
    assert 'infergate_request_duration_seconds_bucket{le="0.001",model="mlp"' in text


@pytest.mark.parametrize(
    ("host", "log_format", "url_host"),
    [("127.0.0.1", "text", "127.0.0.1"), ("::1", "json", "[::1]")],
)
def test_serve_logs_where_it_listens(
    tmp_path: Path, host: str, log_format: str, url_host: str
) -> None:
    """One line, once the socket accepts connections: the address a user connects to."""
    (tmp_path / "models").mkdir()
    port = free_port()
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERGATE_")}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "infergate", "serve", "--models", str(tmp_path / "models"),
             "--profile", str(write_profile(tmp_path)), "--host", host, "--port", str(port),
             "--log-format", log_format],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://{url_host}:{port}"
        line = f"listening on {url}"
        wait_until(lambda: line in log.read_text() or process.poll() is not None, what=line)
        text = log.read_text()
        assert text.count(line) == 1, text
        assert httpx.get(f"{url}/v2/health/live").status_code == 200
        if log_format == "json":
            [record] = [json.loads(x) for x in text.splitlines() if line in x]
            assert (record["level"], record["message"]) == ("INFO", line)
        else:
            assert text.index("Application startup complete") < text.index(line)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_json_logs_leave_out_uvicorn_s_coloured_template() -> None:
    """uvicorn's records carry `color_message`, their template with terminal colours
    ("Started server process [\x1b[36m%d\x1b[0m]"): not a field of a JSON line."""
    record = logging.LogRecord("uvicorn.error", logging.INFO, "", 0, "Started %d", (7,), None)
    record.color_message = "Started \x1b[36m%d\x1b[0m"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "Started 7"
    assert "color_message" not in line


def test_a_client_cannot_forge_a_text_log_line() -> None:
    """The access log's path is percent-decoded: a `%0A` in it started a line of the
    client's making (`... POST /admin/tenants 200 ... tenant=admin`), a `%1B` wrote
    terminal escapes. In the text format every message is one line, its controls escaped."""
    forged = "\n2026-01-01 00:00:00,000 INFO    infergate.access: POST /admin/tenants 200"
    record = logging.LogRecord(
        "infergate.access", logging.INFO, __file__, 1, "GET %s 404 tenant=%s", (forged, "-"), None
    )
    line = TextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert "\n" not in line
    assert line == (
        "INFO infergate.access: GET \\n2026-01-01 00:00:00,000 INFO    infergate.access: "
        "POST /admin/tenants 200 404 tenant=-"
    )
    record.args = ("\x1b]0;title\x07\r\x7f\x9b\t", "-")
    assert TextFormatter("%(message)s").format(record) == (
        "GET \\x1b]0;title\\x07\\r\\x7f\\x9b\\t 404 tenant=-"
    )
    try:
        raise ValueError("kept")
    except ValueError:
        record.exc_info = sys.exc_info()
    assert "\nValueError: kept" in TextFormatter("%(message)s").format(record)  # its lines
