"""Scanning the models folder: versions, lone files, model.toml, and what is ignored."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from infergate.engine.repository.scan import is_ignored, model_name_for, scan_repository
from infergate.engine.repository.spec import ModelEntry, TensorSpec, VersionPolicy
from infergate.errors import ConfigError
from infergate.profile import load_profile
from infergate.profile_store import read_profile


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


def test_a_name_with_a_newline_or_a_control_character_is_no_model(tmp_path: Path) -> None:
    """Served, such a name put a line break into every log line and event naming it, and
    the repository API, which checks names whole, could not unload it."""
    touch(tmp_path / "evil\n" / "1" / "model.onnx")
    touch(tmp_path / "lone\n.onnx")
    touch(tmp_path / "bell\x07" / "1" / "model.onnx")
    touch(tmp_path / "m.\n" / "1" / "model.onnx")  # a folder's whole name, not its stem
    touch(tmp_path / "a.b c" / "1" / "model.onnx")
    touch(tmp_path / "good" / "1" / "model.onnx")
    assert [e.name for e in scan_repository(tmp_path)] == ["good"]
    assert model_name_for(tmp_path, tmp_path / "evil\n" / "1" / "model.onnx") is None


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


def test_only_plain_version_numbers_are_versions(tmp_path: Path) -> None:
    """A folder "²" passed str.isdigit and int() refused it: the model froze, "ready" with no
    reason, and a new version never loaded. "١" (Arabic-Indic one) was read as version 1
    and "01" is another "1": either replaced what 1/ held. A number past 64 bits served
    and every admin view of every model answered 500. Each is now a folder like any other,
    not a version."""
    for name in ("1", "2", "²", "١", "01", "0", "99999999999999999999", "999999999999999999"):
        touch(tmp_path / "m" / name / "model.onnx")
    [entry] = scan_repository(tmp_path)
    assert [v.version for v in entry.versions] == [1, 2, 999_999_999_999_999_999]
    assert entry.versions[0].path == tmp_path / "m" / "1" / "model.onnx"
    assert entry.problem is None


def test_a_model_toml_that_is_no_plain_small_file_is_a_problem_not_a_hang(tmp_path: Path) -> None:
    """model.toml was opened and read whole: a FIFO there blocked the thread that read it
    for good (two of them took every file thread: no model loaded again, and the gateway
    did not stop on SIGINT), and a 1.5 GB sparse one took 3 GB and stalled the gateway
    6 s. Each is now the model's problem, named, read no further than 1 MiB."""
    for name in ("fifo", "big", "deep", "binary"):
        touch(tmp_path / name / "1" / "model.onnx")
    os.mkfifo(tmp_path / "fifo" / "model.toml")
    with (tmp_path / "big" / "model.toml").open("wb") as f:
        f.truncate(3 << 29)  # 1.5 GB, sparse
    (tmp_path / "deep" / "model.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000)
    (tmp_path / "binary" / "model.toml").write_bytes(b'runtime = "\xff"')
    scanned: list[list[ModelEntry]] = []
    scan = threading.Thread(target=lambda: scanned.append(scan_repository(tmp_path)))
    scan.start()
    scan.join(30)  # (a hang fails here instead of holding the suite)
    assert not scan.is_alive(), "the scan is stuck on the FIFO"
    problems = {e.name: e.problem or "" for e in scanned[0]}
    assert "not a regular file" in problems["fifo"]
    assert "larger than 1 MiB; it is not read" in problems["big"]
    assert "not valid TOML: nested too deeply" in problems["deep"]
    assert "not valid TOML: not UTF-8" in problems["binary"]


def test_a_profile_nested_too_deeply_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """One deeply nested edit raised RecursionError, which the profile's watcher did not
    catch: it died without a word, and no later edit (a key revoked) ever applied. Its
    live reload (`read_profile`) read the file first on its own: a FIFO blocked it (and
    every admin edit behind its lock), a file not UTF-8 raised UnicodeDecodeError."""
    profile = tmp_path / "profile.toml"
    profile.write_text("x = " + "{a = " * 50_000 + "1" + "}" * 50_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_profile(profile)
    with pytest.raises(ConfigError, match="nested too deeply"):
        read_profile(profile)
    profile.write_bytes(b"# caf\xe9\n[server]\n")
    with pytest.raises(ConfigError, match="not valid TOML: not UTF-8"):
        read_profile(profile)
    profile.unlink()
    os.mkfifo(profile)
    read: list[BaseException] = []

    def reload() -> None:
        try:
            read_profile(profile)
        except ConfigError as exc:
            read.append(exc)

    thread = threading.Thread(target=reload)
    thread.start()
    thread.join(30)  # (a hang fails here instead of holding the suite)
    assert not thread.is_alive(), "the reload is stuck on the FIFO"
    assert "not a regular file" in str(read[0])
