"""What is on disk: scan a models folder into ModelEntry records."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from infergate.engine.repository.modelconfig import parse_model_config
from infergate.engine.repository.spec import ModelConfig, ModelEntry, ModelVersionFile
from infergate.engine.runtimes import model_suffixes, runtime_for
from infergate.errors import ConfigError
from infergate.settings.table import read_toml

# A version folder's name: a whole number from 1, in ASCII digits, without leading zeros,
# that fits a signed 64-bit integer as the V2 paths and Triton's statistics carry it
# (str.isdigit takes "²", which int() refuses, and "١", which it reads as 1: another "1").
_VERSION = re.compile(r"[1-9][0-9]{0,17}")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_model_name(name: str) -> bool:
    """Whether `name` may be a model's: letters, digits, '_', '-' and '.', not starting
    with '.'. Whole: `match` with `$` also took a name ending in a newline, served, and
    put into log lines, but refused by the repository API."""
    return _NAME.fullmatch(name) is not None


def is_ignored(path: Path) -> bool:
    """Editors' and copiers' temporaries, and hidden files, are never models."""
    name = path.name
    return name.startswith((".", "~")) or name.endswith(
        ("~", ".swp", ".swx", ".tmp", ".part", ".crdownload")
    )


def _model_file(folder: Path) -> Path | None:
    candidates = [
        p
        for p in sorted(folder.iterdir())
        if p.is_file() and not is_ignored(p) and runtime_for(p) is not None
    ]
    return candidates[0] if candidates else None


def _scan_folder(folder: Path) -> ModelEntry:
    name = folder.name
    config = ModelConfig()
    toml_path = folder / "model.toml"
    toml_sha256 = None
    if toml_path.exists():
        try:
            data = read_toml(toml_path)
            config = parse_model_config(toml_path, data)
        except ConfigError as exc:
            return ModelEntry(name=name, config=config, versions=(), problem=str(exc))
        toml_sha256 = hashlib.sha256(data).hexdigest()
    if config.runtime == "remote":
        # Nothing on disk to serve: version 1 is the remote model (and version) that
        # model.toml names, and model.toml's digest says which configuration serves.
        remote = ModelVersionFile(1, toml_path, "remote")
        return ModelEntry(name=name, config=config, versions=(remote,), toml_sha256=toml_sha256)
    versions: list[ModelVersionFile] = []
    for child in sorted(folder.iterdir()):
        if not child.is_dir() or not _VERSION.fullmatch(child.name):
            continue
        model_file = _model_file(child)
        if model_file is None:
            continue
        runtime = config.runtime or runtime_for(model_file)
        assert runtime is not None  # _model_file chose a file some runtime opens
        versions.append(ModelVersionFile(int(child.name), model_file, runtime))
    versions.sort(key=lambda v: v.version)
    problem = None
    if not versions:
        problem = (
            f"{folder}: no model file found; put one at {folder}/1/model.onnx "
            "(or model.pt for TorchScript)"
        )
    entry = ModelEntry(name, config, tuple(versions), problem, toml_sha256)
    return entry


def _lone_file(root: Path, name: str) -> Path | None:
    for suffix in model_suffixes():
        candidate = root / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def scan_model(root: Path, name: str) -> ModelEntry | None:
    """One model as it is on disk now, or None when it is gone."""
    folder = root / name
    if folder.is_dir():
        return _scan_folder(folder)
    lone = _lone_file(root, name)
    if lone is None:
        return None
    runtime = runtime_for(lone)
    assert runtime is not None  # _lone_file looked only for such files
    version = ModelVersionFile(1, lone, runtime)
    return ModelEntry(name=name, config=ModelConfig(), versions=(version,))


def model_names(root: Path) -> list[str]:
    """The names of the models under `root`: folders, and lone model files by stem."""
    if not root.is_dir():
        raise ConfigError(f"models folder {root} does not exist; create it or pass --models DIR")
    names = set()
    for child in root.iterdir():
        if is_ignored(child):
            continue
        if child.is_dir():
            if is_model_name(child.name):
                names.add(child.name)
        elif child.is_file() and runtime_for(child) is not None and is_model_name(child.stem):
            names.add(child.stem)  # a folder of the same name wins in scan_model
    return sorted(names)


def model_name_for(root: Path, path: Path, folder: bool = True) -> str | None:
    """Which model a changed path belongs to, or None for paths no model cares about.
    `folder`: whether `path` is (or was) a folder; a file in the models folder itself is a
    model only as a lone model file (a stray README.md, or thousands of files written
    there, are no models to look for)."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return None
    if not parts or any(is_ignored(Path(part)) for part in parts):
        return None
    first = parts[0]
    if len(parts) == 1:
        stem = first.removesuffix(".sig")
        suffix = Path(stem).suffix
        if suffix in model_suffixes():
            return Path(stem).stem
        if not folder:
            return None
    return first if is_model_name(first) else None


def scan_repository(root: Path) -> list[ModelEntry]:
    """Every model under `root`, sorted by name; problems are recorded, not raised."""
    entries = [scan_model(root, name) for name in model_names(root)]
    return [e for e in entries if e is not None]
