"""Loading is bounded and configurable: memory_mb holds from the first byte a version
loads, and warm-up is what model.toml says ([warmup]), as Triton's model_warmup."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from infergate.engine.repository.modelconfig import parse_model_config
from infergate.engine.repository.spec import TensorSpec, Warmup
from infergate.engine.runtimes.base import WARMUP_FILE_MAX_BYTES, warmup_inputs
from infergate.errors import ConfigError, WarmupInputError
from tests.conftest import write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

WARMUPS = {
    "zeros": "",
    "random": '[warmup]\ndata = "random"\nlow = 1\nhigh = 2\n',
    "npy": '[warmup]\nfile = "sample.npy"\n',
    "json": '[warmup]\nfile = "sample.json"\n',
    "none": '[warmup]\ndata = "none"\n',
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("warmup")
    models = root / "models"
    for name, table in WARMUPS.items():
        make_scripted(models / name / "1" / "model.scripted", controls=(), reject_zeros=True)
        (models / name / "model.toml").write_text(table)
    np.save(models / "npy" / "sample.npy", np.ones((2, 4), dtype=np.float32))
    request = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    (models / "json" / "sample.json").write_text(json.dumps(request))
    # Holds 200 MB for 3 s while loading, with a limit of 100 MB.
    make_scripted(
        models / "hungry" / "1" / "model.scripted", controls=(), load_alloc_mb=200, load_ms=3000
    )
    (models / "hungry" / "model.toml").write_text("memory_mb = 100\n")
    profile = write_profile(root, "[devices]\nmonitor_interval_s = 0.05\n")
    proc = ServerProcess(models, profile, root / "server.log").start()
    yield proc
    proc.stop()


def test_a_model_that_rejects_zeros_says_the_warm_up_input_did_it(
    server: ServerProcess,
) -> None:
    model = server.wait_model_state("zeros", "failed")
    reason = model["reason"]
    assert "gateway's warm-up input (zeros" in reason
    assert "x is all zeros" in reason
    assert "[warmup]" in reason


@pytest.mark.parametrize("name", ["random", "npy", "json", "none"])
def test_the_warm_up_model_toml_asks_for_lets_it_load(server: ServerProcess, name: str) -> None:
    server.wait_model_state(name, "ready")
    response = httpx.post(
        f"{server.url}/v2/models/{name}/infer", json=scripted_inputs(rows=1), timeout=30
    )
    assert response.status_code == 200, response.text


def test_memory_mb_holds_while_a_version_loads(server: ServerProcess) -> None:
    model = server.wait_model_state("hungry", "failed")
    assert "over its memory limit of 100 MB" in model["reason"]
    assert "used" in model["reason"]
    assert not any(e["kind"] == "model_ready" for e in model["events"])


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[warmup]\ndata = "file"\n', 'data = "file" needs file'),
        ('[warmup]\ndata = "random"\nlow = 3\nhigh = 1\n', "expected low <= high"),
        ('[warmup]\nfile = "sample.csv"\n', "expected a .npy, .npz or .json"),
        ('[warmup]\ndata = "ones"\n', "zeros"),
        ('[warmup]\nfile = "/etc/sample.npy"\n', "expected a file in the model's folder"),
        ('[warmup]\nfile = "../other/sample.npy"\n', "expected a file in the model's folder"),
    ],
)
def test_warmup_mistakes_are_named(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "model.toml"
    path.write_text(table)
    with pytest.raises(ConfigError, match=message):
        parse_model_config(path)


def test_a_sample_file_is_found_beside_model_toml(tmp_path: Path) -> None:
    path = tmp_path / "model.toml"
    path.write_text('[warmup]\nfile = "sample.npz"\n')
    warmup = parse_model_config(path).warmup
    assert (warmup.data, warmup.file) == ("file", tmp_path / "sample.npz")


def test_a_warm_up_file_over_64_mib_is_refused_unread(tmp_path: Path) -> None:
    """A warm-up file of 3 million rows, read at each restart, held a load slot until the
    load timeout: a warm-up file holds at most 64 MiB, checked before it is read."""
    sample = tmp_path / "sample.npy"
    with sample.open("wb") as f:
        f.truncate(WARMUP_FILE_MAX_BYTES + 1)  # sparse, and no .npy inside: never read
    specs = (TensorSpec("x", "FP32", (-1, 4)),)
    with pytest.raises(WarmupInputError, match="holds 64 MiB, over the 64 MiB"):
        warmup_inputs(specs, Warmup(data="file", file=sample))


def test_a_warm_up_file_is_read_only_from_inside_the_model_s_folder(tmp_path: Path) -> None:
    """model.toml named a relative file, a link to any file of the host's: the load read
    it, and the error ("it has SECRET...") showed its array names to every caller. A link
    within the model's folder (a ConfigMap's `..data`) is read; one out of it is refused."""
    folder = tmp_path / "models" / "m"
    (folder / "..data").mkdir(parents=True)
    np.save(folder / "..data" / "inside.npy", np.ones((2, 4), np.float32))
    (folder / "sample.npy").symlink_to(folder / "..data" / "inside.npy")
    np.save(tmp_path / "secret.npy", np.zeros((1, 4), np.float32))
    (folder / "out.npy").symlink_to(tmp_path / "secret.npy")
    specs = (TensorSpec("x", "FP32", (-1, 4)),)
    inputs = warmup_inputs(specs, Warmup("file", file=folder / "sample.npy", folder=folder))
    assert inputs is not None
    assert inputs["x"].shape == (2, 4)
    with pytest.raises(WarmupInputError, match="is a link out of the model's folder"):
        warmup_inputs(specs, Warmup("file", file=folder / "out.npy", folder=folder))
