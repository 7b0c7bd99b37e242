"""What is on disk: scan a models folder into ModelEntry records (DESIGN §2)."""

from __future__ import annotations

import re
from pathlib import Path

from infergate.engine.modelconfig import parse_model_config
from infergate.engine.spec import MODEL_FILE_RUNTIMES, ModelConfig, ModelEntry, ModelVersionFile
from infergate.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


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
        if p.is_file() and not is_ignored(p) and p.suffix in MODEL_FILE_RUNTIMES
    ]
    return candidates[0] if candidates else None


def _scan_folder(folder: Path) -> ModelEntry:
    name = folder.name
    config = ModelConfig()
    toml_path = folder / "model.toml"
    if toml_path.exists():
        try:
            config = parse_model_config(toml_path)
        except ConfigError as exc:
            return ModelEntry(name=name, config=config, versions=(), problem=str(exc))
    versions: list[ModelVersionFile] = []
    for child in sorted(folder.iterdir()):
        if not child.is_dir() or not child.name.isdigit() or int(child.name) <= 0:
            continue
        model_file = _model_file(child)
        if model_file is None:
            continue
        runtime = config.runtime or MODEL_FILE_RUNTIMES[model_file.suffix]
        versions.append(ModelVersionFile(int(child.name), model_file, runtime))
    versions.sort(key=lambda v: v.version)
    problem = None
    if not versions:
        problem = (
            f"{folder}: no model file found; put one at {folder}/1/model.onnx "
            "(or model.pt for TorchScript)"
        )
    return ModelEntry(name=name, config=config, versions=tuple(versions), problem=problem)


def scan_repository(root: Path) -> list[ModelEntry]:
    """Every model under `root`, sorted by name; problems are recorded, not raised."""
    if not root.is_dir():
        raise ConfigError(f"models folder {root} does not exist; create it or pass --models DIR")
    entries: dict[str, ModelEntry] = {}
    for child in sorted(root.iterdir()):
        if is_ignored(child) or not _NAME.match(child.stem):
            continue
        if child.is_dir():
            entries[child.name] = _scan_folder(child)
        elif child.is_file() and child.suffix in MODEL_FILE_RUNTIMES:
            name = child.stem
            if name in entries:
                continue  # a folder of the same name wins; it can hold versions and config
            version = ModelVersionFile(1, child, MODEL_FILE_RUNTIMES[child.suffix])
            entries[name] = ModelEntry(name=name, config=ModelConfig(), versions=(version,))
    return [entries[k] for k in sorted(entries)]
