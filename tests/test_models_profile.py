"""The live profile cannot open a door: a real server, its profile file edited, emptied
and deleted under it, and the admin API used while that happens."""

from __future__ import annotations

import json
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from infergate.cli.main import app
from infergate.engine.admission.tenants import hash_key
from tests.conftest import REPO
from tests.polling import wait_until
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


def start(folder: Path) -> ServerProcess:
    models = folder / "models"
    make_scripted(models / "m" / "1" / "model.scripted", controls=())
    profile = folder / "profile.toml"
    profile.write_text(PROFILE)
    return ServerProcess(models, profile, folder / "server.log").start()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """For a test whose edit only a restart would undo."""
    proc = start(tmp_path)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start(tmp_path_factory.mktemp("profile"))
    yield proc
    proc.stop()


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """The shared server, its profile as written (restored and applied, whatever the test
    before did to the file)."""
    if not shared_server.profile.exists() or shared_server.profile.read_text() != PROFILE:
        shared_server.profile.write_text(PROFILE)
    shared_server.profile.chmod(0o644)
    wait_until(lambda: as_written(shared_server), what="the profile as written to apply")
    return shared_server


def as_written(server: ServerProcess) -> bool:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    doc = httpx.get(f"{server.url}/admin/tenants", headers=headers, timeout=10).json()
    tenants = {t["name"]: t["rps"] for t in doc["tenants"]}
    return doc["profile_error"] is None and tenants == {"default": 1000, "alice": None}


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


def events_now(server: ServerProcess, key: str = ADMIN) -> list[dict[str, Any]]:
    """The gateway's events so far, from the admin model view's recent events (all kinds
    with no model are in the stream; read it until it goes quiet)."""
    out = []
    headers = {"Authorization": f"Bearer {key}"}
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
    own_server: ServerProcess,
) -> None:
    server = own_server
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


def test_edits_through_the_cli_with_a_relative_profile_need_no_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's walk-through, in a project folder where `infergate serve` reads
    profiles/default.toml (a relative path): a tenant key, a tenant setting and an admin
    key apply at once, with no false "restart needed"; a [server] edit names what changed."""
    project = tmp_path / "project"
    make_scripted(project / "models" / "m" / "1" / "model.scripted", controls=())
    (project / "profiles").mkdir()
    shutil.copy(REPO / "profiles" / "default.toml", project / "profiles" / "default.toml")
    relative = Path("profiles/default.toml")
    proc = ServerProcess(project / "models", relative, tmp_path / "server.log", cwd=project).start()
    monkeypatch.chdir(project)  # the CLI's --profile default is relative too
    try:
        code, out = cli("key", "new", "--tenant", "trial", "--write")
        assert code == 0, out
        wait_until(lambda: "trial" in tenant_names(proc, None), what="tenant trial to apply")
        code, out = cli("tenant", "set", "trial", "weight=2", "--url", proc.url)
        assert code == 0, out
        code, out = cli("key", "new", "--admin", "--write", "--json")
        assert code == 0, out
        key = json.loads(out)["key"]
        wait_until(lambda: admin(proc) == 401, what="the admin key to apply")
        # A real [server] change: its event names the fields, and is the only one.
        text = relative.read_text().replace("port = 8000", "port = 8001")
        relative.write_text(text.replace('models = "models"', 'models = "elsewhere"'))
        events = wait_until(
            lambda: restarts_needed(proc, key) or None, what="the [server] change's event"
        )
        assert events == [
            "[server] models, port changed; they apply at the next start (infergate serve)"
        ]
    finally:
        proc.stop()


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"INFERGATE_ADMIN_TOKEN": ""})
    return result.exit_code, result.output


def tenant_names(server: ServerProcess, key: str | None) -> set[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    doc = httpx.get(f"{server.url}/admin/tenants", headers=headers, timeout=10).json()
    return {t["name"] for t in doc["tenants"]}


def restarts_needed(server: ServerProcess, key: str) -> list[str]:
    return [e["message"] for e in events_now(server, key) if e["kind"] == "profile_restart_needed"]
