"""The profile (DESIGN §3): server settings, batching defaults, priority classes, and the
default tenant's class. Breakers and the rest of the tenants' keys are accepted as tables
for the parts that will own them. Unknown sections and keys are named, not ignored."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infergate.engine.scheduling.classes import DEFAULT_CLASSES, PriorityClass
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.engine.tomltable import Table, load_toml
from infergate.errors import ConfigError

DEFAULT_PROFILE = Path("profiles/default.toml")
_OWNED_ELSEWHERE = ("breaker",)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    models: Path = Path("models")
    max_request_mb: float = 64.0
    load_timeout_s: float = 120.0
    model_control: str = "poll"
    file_stable_s: float = 1.0
    drain_timeout_s: float = 30.0
    require_signed_models: bool = False
    trusted_keys: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Profile:
    source: Path | None
    server: ServerSettings = field(default_factory=ServerSettings)
    batching: QueuePolicy = field(default_factory=QueuePolicy)
    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    default_class: str = "burst"
    sections: dict[str, Any] = field(default_factory=dict)


def _batching(table: Table) -> QueuePolicy:
    defaults = QueuePolicy()
    policy = QueuePolicy(
        max_batch_size=table.integer("max_batch_size", defaults.max_batch_size, minimum=0),
        max_delay_s=table.number("max_queue_delay_ms", defaults.max_delay_s * 1000, minimum=0)
        / 1000.0,
        max_queue_size=table.integer("max_queue_size", defaults.max_queue_size, minimum=1),
    )
    table.reject_unknown()
    return policy


def _classes(table: Table) -> tuple[PriorityClass, ...]:
    names = table.keys()
    if not names:
        return DEFAULT_CLASSES
    out = []
    for name in names:
        entry = table.table(name)
        rank = entry.integer("rank", None, minimum=0)
        deadline = entry.number("deadline_ms", None, minimum=0.1)
        if rank is None or deadline is None:
            raise ConfigError(f"{entry.where('')}: each class needs rank and deadline_ms")
        entry.reject_unknown()
        out.append(PriorityClass(name, rank, deadline / 1000.0))
    return tuple(out)


def _default_class(tenants: Table, classes: tuple[PriorityClass, ...]) -> str:
    """The default tenant's class (the rest of [tenants] belongs to the tenants issue)."""
    default = tenants.table("default")
    name = default.string(
        "class", "burst" if any(c.name == "burst" for c in classes) else classes[-1].name
    )
    if name not in {c.name for c in classes}:
        raise ConfigError(
            f"{default.where('class')}: {name!r} is not a class; the profile defines "
            f"{', '.join(c.name for c in classes)}"
        )
    default.keys()  # rps, burst, max_concurrency, ...: validated where tenants are enforced
    tenants.keys()
    return name


def _key_paths(server: Table, base: Path) -> tuple[Path, ...]:
    keys = server.array("trusted_keys", [])
    if not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{server.where('trusted_keys')}: expected paths to .pub files")
    paths = tuple(Path(k) if Path(k).is_absolute() else base / k for k in keys)
    for key in paths:
        if not key.is_file():
            raise ConfigError(f"{server.where('trusted_keys')}: {key} does not exist")
    return paths


def load_profile(path: Path | None) -> Profile:
    """Read a profile; None or a missing default gives the built-in defaults."""
    if path is None:
        if not DEFAULT_PROFILE.exists():
            return Profile(source=None)
        path = DEFAULT_PROFILE
    if not path.exists():
        raise ConfigError(f"profile {path} does not exist; pass --profile FILE or create it")
    data = load_toml(path)
    root = Table(data, path)
    server = root.table("server")
    defaults = ServerSettings()
    models = server.string("models", str(defaults.models))
    models_path = Path(models)
    if not models_path.is_absolute() and path.parent.name == "profiles":
        # "models" in profiles/default.toml means the models folder beside profiles/.
        models_path = path.parent.parent / models_path
    settings = ServerSettings(
        host=server.string("host", defaults.host),
        port=server.integer("port", defaults.port, minimum=0),
        models=models_path,
        max_request_mb=server.number("max_request_mb", defaults.max_request_mb, minimum=0.001),
        load_timeout_s=server.number("load_timeout_s", defaults.load_timeout_s, minimum=1),
        model_control=server.string(
            "model_control", defaults.model_control, choices=("poll", "explicit")
        ),
        file_stable_s=server.number("file_stable_s", defaults.file_stable_s, minimum=0.05),
        drain_timeout_s=server.number("drain_timeout_s", defaults.drain_timeout_s, minimum=0),
        require_signed_models=server.boolean(
            "require_signed_models", defaults.require_signed_models
        ),
        trusted_keys=_key_paths(server, path.parent),
    )
    if settings.require_signed_models and not settings.trusted_keys:
        raise ConfigError(
            f"{path}: server.require_signed_models is true but server.trusted_keys is empty; "
            "add the .pub files of the keys you sign with (infergate model keygen makes one)"
        )
    server.reject_unknown()
    classes = _classes(root.table("classes"))
    profile = Profile(
        source=path,
        server=settings,
        batching=_batching(root.table("batching")),
        classes=classes,
        default_class=_default_class(root.table("tenants"), classes),
        sections={name: data.get(name, {}) for name in _OWNED_ELSEWHERE},
    )
    for name in _OWNED_ELSEWHERE:
        root.table(name)  # checked to be a table; its keys are validated by its owner
    root.reject_unknown()
    return profile
