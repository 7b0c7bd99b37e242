"""The live profile cannot open a door: a real server, its profile file edited, emptied
and deleted under it, and the admin API used while that happens."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infergate.engine.admission.tenants import hash_key
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

ADMIN, ALICE = "admin-key", "alice-key"
PROFILE = f"""
# a profile with keys
[server]
file_stable_s = 0.1
admin_keys = ["{hash_key(ADMIN)}"]

[tenants.default]
rps = 1000
burst = 1000

[tenants.alice]
api_keys = ["{hash_key(ALICE)}"]
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    models = tmp_path / "models"
    make_scripted(models / "m" / "1" / "model.scripted", controls=())
    profile = tmp_path / "profile.toml"
    profile.write_text(PROFILE)
    proc = ServerProcess(models, profile, tmp_path / "server.log")
    yield proc.start()
    proc.stop()


def admin(server: ServerProcess, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.url}/admin/models", headers=headers, timeout=10).status_code


def wait_event(server: ServerProcess, kind: str, text: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        for event in events_now(server):
            if event["kind"] == kind and text in event["message"]:
                return event
        assert time.monotonic() < deadline, f"no {kind} event saying {text!r}"
        time.sleep(0.05)


def events_now(server: ServerProcess) -> list[dict[str, Any]]:
    """The gateway's events so far, from the admin model view's recent events (all kinds
    with no model are in the stream; read it until it goes quiet)."""
    out = []
    headers = {"Authorization": f"Bearer {ADMIN}"}
    try:
        with httpx.stream(
            "GET",
            f"{server.url}/admin/events?replay=1000",
            headers=headers,
            timeout=httpx.Timeout(10, read=0.5),
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    out.append(json.loads(line[5:]))
    except httpx.ReadTimeout:
        pass  # the history has been replayed; the stream waits for news
    return out


def test_an_emptied_profile_is_rejected_and_the_keys_still_hold(server: ServerProcess) -> None:
    assert admin(server) == 401
    server.profile.write_text("")
    wait_event(server, "profile_rejected", "is empty")
    assert admin(server) == 401
    assert admin(server, ADMIN) == 200


def test_loosening_waits_for_a_restart_and_tightening_applies_live(
    server: ServerProcess,
) -> None:
    body = scripted_inputs(rows=1)
    assert httpx.post(f"{server.url}/v2/models/m/infer", json=body).status_code == 200
    text = server.profile.read_text()
    # One edit: the admin keys go (that would open the admin API), anonymous use ends.
    text = text.replace(f'admin_keys = ["{hash_key(ADMIN)}"]', "allow_anonymous = false")
    server.profile.write_text(text)
    wait_event(server, "profile_restart_needed", "server.admin_keys")
    assert admin(server) == 401  # still closed
    assert admin(server, ADMIN) == 200
    assert httpx.post(f"{server.url}/v2/models/m/infer", json=body).status_code == 401
    headers = {"Authorization": f"Bearer {ALICE}"}
    ok = httpx.post(f"{server.url}/v2/models/m/infer", json=body, headers=headers)
    assert ok.status_code == 200


def test_an_edit_when_the_file_is_missing_is_a_409_naming_it(server: ServerProcess) -> None:
    server.profile.unlink()
    wait_event(server, "profile_rejected", "is missing")
    response = httpx.post(
        f"{server.url}/admin/tenants",
        json={"name": "carol"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
    )
    assert response.status_code == 409, response.text
    assert str(server.profile) in response.json()["error"]
    assert not server.profile.exists()  # not rewritten with one table
    assert admin(server) == 401


def test_an_edit_keeps_the_mode_and_leaves_no_temporary_file(server: ServerProcess) -> None:
    server.profile.chmod(0o640)
    response = httpx.post(
        f"{server.url}/admin/tenants",
        json={"name": "carol"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    assert stat.S_IMODE(server.profile.stat().st_mode) == 0o640
    assert sorted(p.name for p in server.profile.parent.iterdir() if p.is_file()) == [
        "profile.toml",
        "server.log",
    ]
    assert "[tenants.carol]" in server.profile.read_text()
    assert "# a profile with keys" in server.profile.read_text()
