"""The profile (DESIGN §3): server settings now; batching, breakers, classes and tenants
are read by the parts that own them. Unknown sections and keys are named, not ignored."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infergate.engine.tomltable import Table, load_toml
from infergate.errors import ConfigError

DEFAULT_PROFILE = Path("profiles/default.toml")
_OWNED_ELSEWHERE = ("batching", "breaker", "classes", "tenants")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    models: Path = Path("models")
    max_request_mb: float = 64.0
    load_timeout_s: float = 120.0


@dataclass(frozen=True)
class Profile:
    source: Path | None
    server: ServerSettings = field(default_factory=ServerSettings)
    sections: dict[str, Any] = field(default_factory=dict)


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
    )
    server.reject_unknown()
    for name in _OWNED_ELSEWHERE:
        root.table(name)  # checked to be a table; its keys are validated by its owner
    root.reject_unknown()
    return Profile(
        source=path,
        server=settings,
        sections={name: data.get(name, {}) for name in _OWNED_ELSEWHERE},
    )
