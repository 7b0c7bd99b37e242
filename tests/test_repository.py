"""Scanning the models folder: versions, lone files, model.toml, and what is ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from infergate.engine.repository.scan import is_ignored, scan_repository
from infergate.engine.repository.spec import TensorSpec, VersionPolicy
from infergate.errors import ConfigError


def touch(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_versions_lone_files_and_runtimes(tmp_path: Path) -> None:
    touch(tmp_path / "digits" / "1" / "model.onnx")
    touch(tmp_path / "digits" / "3" / "model.onnx")
    touch(tmp_path / "digits" / "notes" / "model.onnx")  # not a version number
    touch(tmp_path / "encoder" / "1" / "model.pt")
    touch(tmp_path / "plain.onnx")
    touch(tmp_path / "README.md")
    entries = {e.name: e for e in scan_repository(tmp_path)}
    assert sorted(entries) == ["digits", "encoder", "plain"]
    assert [v.version for v in entries["digits"].versions] == [1, 3]
    assert [v.version for v in entries["digits"].served_versions()] == [3]
    assert entries["encoder"].versions[0].runtime == "torchscript"
    assert entries["plain"].versions[0].path == tmp_path / "plain.onnx"
    assert all(e.problem is None for e in entries.values())


@pytest.mark.parametrize(
    "name",
    [".hidden.onnx", "model.onnx~", "model.onnx.swp", "x.tmp", "model.onnx.part", "~lock.onnx"],
)
def test_temporaries_are_ignored(tmp_path: Path, name: str) -> None:
    assert is_ignored(Path(name))
    touch(tmp_path / "m" / "1" / name)
    [entry] = scan_repository(tmp_path)
    assert entry.versions == ()
    assert "no model file found" in (entry.problem or "")


def test_model_toml_is_read(tmp_path: Path) -> None:
    touch(tmp_path / "enc" / "1" / "model.pt")
    touch(
        tmp_path / "enc" / "model.toml",
        """
runtime = "torchscript"
instances = 2
device = "cpu"
timeout_ms = 250
[version_policy]
versions = [1]
[[inputs]]
name = "features"
datatype = "FP32"
shape = [-1, 8]
[[outputs]]
name = "embedding"
datatype = "FP32"
shape = [-1, 4]
""",
    )
    [entry] = scan_repository(tmp_path)
    assert entry.problem is None
    config = entry.config
    assert (config.instances, config.device, config.timeout_s) == (2, "cpu", 0.25)
    assert config.inputs == (TensorSpec("features", "FP32", (-1, 8)),)
    assert config.version_policy == VersionPolicy(versions=(1,))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("instances = 0", "instances: expected an integer from 1 to 256, got 0"),
        ("instances = true", "instances: expected an integer, got True"),
        ("runtime = 'tensorflow'", "runtime: expected one of onnx, torchscript"),
        ("instanses = 2", "unknown key instanses"),
        ("[[inputs]]\nname = 'x'\ndatatype = 'FLOAT'\nshape = [1]", "inputs[0].datatype"),
        ("[[inputs]]\nname = 'x'\ndatatype = 'FP32'\nshape = [-2]", "inputs[0].shape"),
        ("[version_policy]\nlatest = 0", "version_policy.latest"),
        ("instances = ", "not valid TOML"),
        # The profile's breaker bounds hold in model.toml too (a 0 s window spun the clock).
        ("[breaker]\nwindow_seconds = 0", "breaker.window_seconds: expected a number >= 0.1"),
        ("[breaker]\nfailure_rate = 7", "breaker.failure_rate: expected a fraction between 0"),
        ("[breaker]\nbackoff_initial_s = 0", "breaker.backoff_initial_s: expected a number >="),
    ],
)
def test_bad_model_toml_names_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    touch(tmp_path / "m" / "1" / "model.onnx")
    toml = touch(tmp_path / "m" / "model.toml", text)
    [entry] = scan_repository(tmp_path)
    assert entry.problem is not None
    assert str(toml) in entry.problem
    assert message in entry.problem


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        (VersionPolicy(), [4]),
        (VersionPolicy(latest=2), [3, 4]),
        (VersionPolicy(all=True), [1, 2, 3, 4]),
        (VersionPolicy(versions=(1, 3, 9)), [1, 3]),
    ],
)
def test_version_policy(policy: VersionPolicy, served: list[int]) -> None:
    assert policy.select([4, 1, 3, 2]) == served


def test_missing_folder_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; create it or pass --models"):
        scan_repository(tmp_path / "nope")
