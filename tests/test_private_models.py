"""`[server] private_models = true`: what the gateway says about models (metadata,
readiness, config, statistics, /metrics) is only for those who may use them. By default
those routes are open, as in Triton (tests/test_v2_api.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.engine.admission.tenants import hash_key
from infergate.loadgen import Target
from infergate.server_split import server_split_reader
from tests.onnx_models import make_mlp
from tests.polling import wait_until
from tests.server import ServerProcess, free_port

ADMIN, NARROW = "admin-key", "narrow-key"

PROFILE = f"""
[server]
allow_anonymous = false
private_models = true
admin_keys = ["{hash_key(ADMIN)}"]

[tenants.narrow]
models = ["mlp", "m*"]
api_keys = ["{hash_key(NARROW)}"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """mlp in narrow's list; other outside it."""
    folder = tmp_path_factory.mktemp("private")
    models = folder / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    make_mlp(models / "other" / "1" / "model.onnx", seed=9)
    profile = folder / "profile.toml"
    profile.write_text(PROFILE)
    proc = ServerProcess(models, profile, folder / "server.log").start()
    yield proc
    proc.stop()


def get(server: ServerProcess, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.url}{path}", headers=headers, timeout=10)


MODEL_ROUTES = ("", "/ready", "/config", "/stats", "/versions/1", "/versions/1/ready")


def test_a_tenant_sees_only_the_models_it_may_use(server: ServerProcess) -> None:
    for tail in MODEL_ROUTES:
        assert get(server, f"/v2/models/mlp{tail}", NARROW).status_code == 200, tail
        refused = get(server, f"/v2/models/other{tail}", NARROW)
        assert refused.status_code == 403, (tail, refused.text)
        assert "may not use model 'other' (allowed: mlp, m*)" in refused.json()["error"]
    # Unknown, inside its list: a 404 that names only what it may use.
    unknown = get(server, "/v2/models/mnope", NARROW)
    assert unknown.status_code == 404
    assert "served models: mlp." in unknown.json()["error"]


def test_without_a_key_nothing_is_said_and_an_admin_sees_everything(
    server: ServerProcess,
) -> None:
    for name in ("mlp", "other", "nosuch"):
        refused = get(server, f"/v2/models/{name}", None)
        assert refused.status_code == 401, refused.text
        assert name not in refused.json()["error"]
    assert get(server, "/v2/models/other/config", ADMIN).status_code == 200
    assert "served models: mlp, other." in get(server, "/v2/models/x", ADMIN).json()["error"]


def test_every_models_statistics_and_metrics_are_the_admins(server: ServerProcess) -> None:
    for path in ("/metrics", "/v2/models/stats"):
        assert get(server, path, None).status_code == 401, path
        assert get(server, path, NARROW).status_code == 403, path
        assert get(server, path, ADMIN).status_code == 200, path
        # A narrow key, then the admin's (as a client's header after a proxy's): the last
        # one ran. Two keys are a 400, here and on /admin.
        keys = [("Authorization", f"Bearer {NARROW}"), ("Authorization", f"Bearer {ADMIN}")]
        twice = httpx.get(f"{server.url}{path}", headers=keys)
        assert twice.status_code == 400, (path, twice.text)
    admin = httpx.get(f"{server.url}/admin/tenants", headers=keys)
    assert admin.status_code == 400, admin.text
    # Health and the server's own metadata say nothing of models: open.
    for path in ("/v2/health/live", "/v2/health/ready", "/v2"):
        assert get(server, path, None).status_code == 200, path


def test_private_models_without_admin_keys_does_not_start(tmp_path: Path) -> None:
    """Without admin keys every caller counts as an operator: the setting would hide
    nothing, so the gateway refuses it in one line."""
    (tmp_path / "models").mkdir()
    profile = tmp_path / "profile.toml"
    profile.write_text("[server]\nprivate_models = true\n")
    started = subprocess.run(
        [sys.executable, "-m", "infergate", "serve", "--profile", str(profile)]
        + ["--models", str(tmp_path / "models"), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 2
    assert "server.private_models is set but server.admin_keys is empty" in started.stderr
    # The command that fixes it writes to this profile, not the default one.
    assert f"infergate key new --admin --write --profile {profile}" in started.stderr


async def test_a_loads_split_is_read_with_its_own_key(server: ServerProcess) -> None:
    """`infergate bench --token` reads the model's statistics with the tenant's key: a
    model's statistics need one here."""
    headers = {"Authorization": f"Bearer {NARROW}"}
    target = Target(server.url, "/v2/models/mlp/infer", b"", headers, model="mlp")
    assert await server_split_reader(target)() is not None


def test_health_names_no_model(tmp_path: Path) -> None:
    """Under strict readiness the gateway is not ready while a model failed to load; with
    private_models its answer does not say which (an operator reads /admin/models)."""
    models = tmp_path / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    profile = tmp_path / "profile.toml"
    profile.write_text(PROFILE.replace("[server]\n", "[server]\nstrict_readiness = true\n"))
    proc = ServerProcess(models, profile, tmp_path / "server.log").start()
    try:
        staged = tmp_path / "zbroken"
        (staged / "1").mkdir(parents=True)
        (staged / "1" / "model.onnx").write_bytes(b"not an onnx file")
        staged.rename(models / "zbroken")
        ready = wait_until(
            lambda: (r := get(proc, "/v2/health/ready", None)).status_code == 503 and r,
            what="readiness to fail on the broken model",
        )
        assert "a model failed to load" in ready.json()["error"]
        assert "zbroken" not in ready.text
        assert "zbroken" in get(proc, "/admin/models", ADMIN).text
    finally:
        proc.stop()
