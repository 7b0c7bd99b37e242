"""A tenant's allow-list is asked before anything about the model: a tenant learns nothing
of a model it may not use (whether it exists, why it does not load), and a 404 names only
the models it may use. The order is 401, 403, then what is wrong with the model, then 429."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from infergate.engine.admission.tenants import hash_key
from tests.onnx_models import make_mlp
from tests.server import ServerProcess

NARROW, WIDE, SPENT = "narrow-key", "wide-key", "spent-key"

PROFILE = f"""
[server]
allow_anonymous = false

[tenants.narrow]
models = ["mlp", "mx*"]
api_keys = ["{hash_key(NARROW)}"]

[tenants.wide]
api_keys = ["{hash_key(WIDE)}"]

[tenants.spent]
models = ["mlp", "mx*"]
rps = 0
burst = 1
api_keys = ["{hash_key(SPENT)}"]
"""

BROKEN_BYTES = b"this is not an onnx file"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """mlp and mxbad in narrow's list (mxbad never loads); other and secret (a file that
    never loads either) outside it."""
    folder = tmp_path_factory.mktemp("allow")
    models = folder / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    make_mlp(models / "other" / "1" / "model.onnx", seed=9)
    for name in ("secret", "mxbad"):
        (models / name / "1").mkdir(parents=True)
        (models / name / "1" / "model.onnx").write_bytes(BROKEN_BYTES)
    profile = folder / "profile.toml"
    profile.write_text(PROFILE)
    proc = ServerProcess(models, profile, folder / "server.log").start()
    yield proc
    proc.stop()


def call(server: ServerProcess, path: str, key: str) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    return httpx.post(
        f"{server.url}/v2/models/{path}/infer",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def error_of(response: httpx.Response) -> str:
    return str(response.json()["error"])


def test_a_model_outside_the_list_is_403_whether_it_exists_or_loads(
    server: ServerProcess,
) -> None:
    answers = {
        path: call(server, path, NARROW)
        for path in ("other", "secret", "nosuch", "secret/versions/7", "nosuch/versions/x")
    }
    for path, answer in answers.items():
        # Nothing about the model (not why it failed, not which models are served): only
        # what the tenant may use.
        name = path.split("/")[0]
        assert answer.status_code == 403, (path, answer.text)
        assert error_of(answer).startswith(
            f"tenant 'narrow' may not use model '{name}' (allowed: mlp, mx*). Hint: "
        )
    # Each refusal is counted as one.
    tenants = httpx.get(f"{server.url}/admin/tenants", timeout=5).json()["tenants"]
    assert next(t for t in tenants if t["name"] == "narrow")["forbidden"] == len(answers)
    # Nor do the metrics (open to any client) name the models it was refused.
    scrape = httpx.get(f"{server.url}/metrics", timeout=5).text
    refused = [
        line
        for line in scrape.splitlines()
        if line.startswith("infergate_requests_total{") and 'tenant="narrow"' in line
    ]
    assert refused
    assert all('model="unknown"' in line for line in refused), refused


def test_inside_the_list_the_model_answers_and_a_404_names_only_allowed_models(
    server: ServerProcess,
) -> None:
    assert call(server, "mlp", NARROW).status_code == 200
    unknown = call(server, "mxnope", NARROW)
    assert unknown.status_code == 404
    assert "served models: mlp, mxbad." in error_of(unknown)
    failed = call(server, "mxbad", NARROW)
    assert failed.status_code == 424
    assert "load failed" in error_of(failed)


def test_a_tenant_without_a_list_is_unchanged(server: ServerProcess) -> None:
    unknown = call(server, "nosuch", WIDE)
    assert unknown.status_code == 404
    assert "served models: mlp, mxbad, other, secret." in error_of(unknown)
    assert call(server, "secret", WIDE).status_code == 424
    assert call(server, "other", WIDE).status_code == 200


def test_the_order_is_401_403_the_model_then_429(server: ServerProcess) -> None:
    assert call(server, "mlp", SPENT).status_code == 200  # its one token: none comes back
    assert call(server, "other", "no-such-key").status_code == 401
    assert call(server, "other", SPENT).status_code == 403  # not 429: refused for the model
    assert call(server, "mxnope", SPENT).status_code == 404
    assert call(server, "mxbad", SPENT).status_code == 424
    assert call(server, "mlp", SPENT).status_code == 429


def test_a_load_failure_names_the_repository_file_and_what_to_do(server: ServerProcess) -> None:
    error = error_of(call(server, "mxbad", WIDE))
    assert str(server.models / "mxbad" / "1" / "model.onnx") in error, error
    assert "infergate-verified" not in error
    assert "Hint: fix or replace the file" in error
    assert "keeps serving" not in error  # nothing else serves mxbad
