"""A model whose runtime is not installed is listed as unavailable, with the install
command, and the other models serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.engine.runtimes import TORCH_INSTALL
from tests.conftest import REPO, write_profile
from tests.onnx_models import make_mlp
from tests.server import ServerProcess

# Loaded at interpreter start through PYTHONPATH: makes `torch` impossible to find, as on
# a machine where it was never installed.
HIDE_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


@pytest.fixture
def torchless_server(tmp_path: Path) -> Iterator[ServerProcess]:
    import shutil

    models = tmp_path / "models"
    shutil.copytree(REPO / "models" / "encoder", models / "encoder")
    make_mlp(models / "mlp" / "1" / "model.onnx")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_TORCH)
    proc = ServerProcess(
        models,
        write_profile(tmp_path),
        tmp_path / "server.log",
        env={"PYTHONPATH": f"{site}:{REPO}"},
    ).start()
    yield proc
    proc.stop()


def test_torch_absent_marks_torchscript_unavailable(torchless_server: ServerProcess) -> None:
    encoder = torchless_server.model("encoder")
    assert encoder["state"] == "unavailable"
    assert "needs torch, which is not installed" in encoder["reason"]
    # The hint names the model to load after the install (it said NAME), once.
    hint = f"Hint: {TORCH_INSTALL}, then infergate model load encoder"
    assert "download.pytorch.org/whl/cpu" in hint  # PyPI's torch is the CUDA build
    assert encoder["reason"].endswith(hint), encoder["reason"]
    # Its instances never start: they say so, not "loading" for good.
    assert [i["state"] for v in encoder["versions"] for i in v["instances"]] == ["unavailable"]
    response = httpx.post(f"{torchless_server.url}/v2/models/encoder/infer", json={"inputs": []})
    assert response.status_code == 424  # only installing torch fixes it: no Retry-After
    assert "retry-after" not in response.headers
    said = response.json()["error"]
    assert "not installed" in said
    assert said.endswith(hint), said  # one hint, not a second "(... model load ... retries)"
    assert said.count("model load encoder") == 1, said
    ok = httpx.post(
        f"{torchless_server.url}/v2/models/mlp/infer",
        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
    )
    assert ok.status_code == 200
