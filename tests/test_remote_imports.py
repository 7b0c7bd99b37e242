"""A gateway without remote models never imports httpx (tens of ms of CPU on every
start): the remote runtime imports it when a remote model loads."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


def test_a_gateway_without_remote_models_starts_and_serves_without_httpx(
    tmp_path: Path,
) -> None:
    models = tmp_path / "models"
    make_scripted(models / "local" / "1" / "model.scripted", controls=())
    # Python writes each import, with its time, to stderr: the server's log.
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    proc = ServerProcess(models, write_profile(tmp_path), tmp_path / "server.log", env)
    proc.start()
    try:
        body = scripted_inputs(rows=1)
        answer = httpx.post(f"{proc.url}/v2/models/local/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
    finally:
        proc.stop()
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.log.read_text().splitlines()]
    assert "infergate.engine.remote.served" in imported  # the log does list the imports
    assert "httpx" not in imported
    assert "infergate.client" not in imported
