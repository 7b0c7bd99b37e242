"""The profile: server settings, batching defaults, priority classes, breaker
defaults (and per-model overrides), and tenants. Each key is declared once in
infergate/settings/profile_sections.py, which checks it here; this module turns the checked
sections into the engine's own records. Unknown sections and keys are named, not ignored;
every error names the file, the key and what was expected."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from infergate.engine.admission.breaker import BreakerPolicy
from infergate.engine.admission.tenants import (
    DEFAULT_TENANT,
    NO_CONCURRENCY_LIMIT,
    NO_RATE_LIMIT,
    Tenant,
)
from infergate.engine.cluster.settings import ClusterSettings
from infergate.engine.scheduling.classes import DEFAULT_CLASSES, ClassTable, PriorityClass
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.engine.settings import LiveSettings
from infergate.errors import ConfigError
from infergate.settings.declare import given
from infergate.settings.profile_sections import (
    BatchingSection,
    BreakerSection,
    ClassSection,
    ClusterSection,
    DevicesSection,
    ServerSection,
    TenantSection,
)
from infergate.settings.table import MAX_PROFILE_BYTES, Table, load_toml, parse_toml

DEFAULT_PROFILE = Path("profiles/default.toml")
_SERVER = ServerSection()  # the declared defaults (infergate/settings/profile_sections.py)
_DEVICES = DevicesSection()


@dataclass(frozen=True)
class ServerSettings:
    """[server], with its paths resolved; each key is declared in ServerSection."""

    host: str = _SERVER.host
    port: int = _SERVER.port
    models: Path = Path(_SERVER.models)
    max_request_mb: float = _SERVER.max_request_mb
    max_bodies_mb: float = _SERVER.max_bodies_mb
    load_timeout_s: float = _SERVER.load_timeout_s
    model_control: str = _SERVER.model_control
    file_stable_s: float = _SERVER.file_stable_s
    drain_timeout_s: float = _SERVER.drain_timeout_s
    require_signed_models: bool = _SERVER.require_signed_models
    trusted_keys: tuple[Path, ...] = ()
    admin_keys: tuple[str, ...] = ()
    allow_anonymous: bool = _SERVER.allow_anonymous
    private_models: bool = _SERVER.private_models
    strict_readiness: bool = _SERVER.strict_readiness
    server_name: str = _SERVER.server_name
    max_concurrent_loads: int = _SERVER.max_concurrent_loads
    # The HTTP edge (see server/http_protocol.py): what one connection may take.
    max_header_kb: float = _SERVER.max_header_kb
    header_timeout_s: float = _SERVER.header_timeout_s
    body_timeout_s: float = _SERVER.body_timeout_s
    keep_alive_timeout_s: float = _SERVER.keep_alive_timeout_s
    max_connections: int = _SERVER.max_connections
    max_connections_per_client: int = _SERVER.max_connections_per_client
    fronts: int = _SERVER.fronts  # front processes (server/front.py); 0: one process


@dataclass(frozen=True)
class DeviceSettings:
    """[devices]; each key is declared in DevicesSection."""

    backend: str = _DEVICES.backend
    simulated_mb: tuple[float, ...] = tuple(_DEVICES.simulated_mb)
    monitor_interval_s: float = _DEVICES.monitor_interval_s
    max_kills: int = _DEVICES.max_kills
    kill_window_s: float = _DEVICES.kill_window_s
    worker_nice: int = _DEVICES.worker_nice


def _devices(table: Table) -> DeviceSettings:
    d = table.read(DevicesSection)
    return DeviceSettings(**{**d.model_dump(), "simulated_mb": tuple(d.simulated_mb)})


@dataclass(frozen=True)
class Profile:
    source: Path | None
    server: ServerSettings = field(default_factory=ServerSettings)
    batching: QueuePolicy = field(default_factory=QueuePolicy)
    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    breaker_models: dict[str, BreakerPolicy] = field(default_factory=dict)
    tenants: tuple[Tenant, ...] = (Tenant(DEFAULT_TENANT),)
    devices: DeviceSettings = field(default_factory=DeviceSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def live_settings(self) -> LiveSettings:
        """What the engine takes from this profile, and swaps in on a live change."""
        return LiveSettings(
            classes=ClassTable(self.classes),
            queue_policy=self.batching,
            breaker=self.breaker,
            breaker_models=self.breaker_models,
            tenants=self.tenants,
            admin_keys=self.server.admin_keys,
            allow_anonymous=self.server.allow_anonymous,
        )

    @property
    def default_class(self) -> str:
        default = next((t for t in self.tenants if t.name == DEFAULT_TENANT), None)
        return default.cls if default else self.classes[-1].name


def _cluster(table: Table) -> ClusterSettings:
    """[cluster]: tenant limits shared through Redis (engine/cluster/)."""
    return ClusterSettings(**table.read(ClusterSection).model_dump())


def _batching(table: Table) -> QueuePolicy:
    b = table.read(BatchingSection)
    return QueuePolicy(b.max_batch_size, b.max_queue_delay_ms / 1000.0, b.max_queue_size)


def _classes(table: Table) -> tuple[PriorityClass, ...]:
    names = table.names()
    if not names:
        return DEFAULT_CLASSES
    out = []
    for name in names:
        entry = table.table(name)
        if not (entry.has("rank") and entry.has("deadline_ms")):
            raise ConfigError(f"{entry.where('')}: each class needs rank and deadline_ms")
        c = entry.read(ClassSection)
        out.append(PriorityClass(name, c.rank, c.deadline_ms / 1000.0))
    return tuple(out)


def breaker_section(table: Table) -> tuple[BreakerPolicy, dict[str, BreakerPolicy]]:
    """[breaker] defaults and [breaker.models.NAME] overrides on top of them."""
    defaults = replace(BreakerPolicy(), **given(table.read(BreakerSection, leave=("models",))))
    models = table.table("models")
    overrides = {}
    for name in models.names():
        overrides[name] = replace(defaults, **given(models.table(name).read(BreakerSection)))
    return defaults, overrides


def default_burst(rps: float) -> float:
    """A tenant that sets rps but no burst may send two seconds' worth at once."""
    return max(1.0, 2.0 * rps) if math.isfinite(rps) else rps


def _tenant(entry: Table, name: str, class_names: list[str]) -> Tenant:
    t = entry.read(TenantSection)
    cls = t.cls if t.cls is not None else "burst" if "burst" in class_names else class_names[-1]
    if cls not in class_names:
        raise ConfigError(
            f"{entry.where('class')}: {cls!r} is not a class; the profile "
            f"defines {', '.join(class_names)}"
        )
    rps = NO_RATE_LIMIT if t.rps is None else t.rps
    return Tenant(
        name=name,
        cls=cls,
        rps=rps,
        burst=default_burst(rps) if t.burst is None else t.burst,
        max_concurrency=NO_CONCURRENCY_LIMIT if t.max_concurrency is None else t.max_concurrency,
        models=tuple(t.models),
        devices=tuple(t.devices),
        memory_mb=t.memory_mb,
        memory_enforced="memory_mb" in t.model_fields_set,
        api_keys=tuple(t.api_keys),
        weight=t.weight,
    )


def _tenants(table: Table, classes: tuple[PriorityClass, ...]) -> tuple[Tenant, ...]:
    names = table.names() or [DEFAULT_TENANT]
    class_names = [c.name for c in classes]
    return tuple(_tenant(table.table(name), name, class_names) for name in names)


def _key_paths(server: Table, keys: list[str], base: Path) -> tuple[Path, ...]:
    paths = tuple(Path(k) if Path(k).is_absolute() else base / k for k in keys)
    for key in paths:
        if not key.is_file():
            raise ConfigError(f"{server.where('trusted_keys')}: {key} does not exist")
    return paths


def _server(table: Table, path: Path) -> ServerSettings:
    s = table.read(ServerSection)
    models = Path(s.models)
    if not models.is_absolute() and path.parent.name == "profiles":
        # "models" in profiles/default.toml means the models folder beside profiles/.
        models = path.parent.parent / models
    settings = ServerSettings(
        **{
            **s.model_dump(),
            "models": models,
            "trusted_keys": _key_paths(table, s.trusted_keys, path.parent),
            "admin_keys": tuple(s.admin_keys),
        }
    )
    if settings.max_bodies_mb < 2 * settings.max_request_mb:
        # One tenant holds at most half of the body budget: a body larger than that could
        # only be let in by holding the whole budget for as long as it takes to arrive.
        raise ConfigError(
            f"{table.where('max_bodies_mb')}: {settings.max_bodies_mb:g} MB is less than "
            f"twice max_request_mb ({settings.max_request_mb:g} MB); one tenant holds at most "
            f"half of it, so the largest body must fit in half. Set max_bodies_mb to "
            f"{2 * settings.max_request_mb:.15g} or more, or lower max_request_mb"
        )
    if settings.require_signed_models and not settings.trusted_keys:
        raise ConfigError(
            f"{path}: server.require_signed_models is true but server.trusted_keys is empty; "
            "add the .pub files of the keys you sign with (infergate model keygen makes one)"
        )
    return settings


def load_profile(path: Path | None, data: bytes | None = None) -> Profile:
    """Read a profile (`data`: its bytes, already read); None or a missing default gives
    the built-in defaults."""
    if path is None:
        if not DEFAULT_PROFILE.exists():
            return Profile(source=None)
        path = DEFAULT_PROFILE
    if not path.exists():
        raise ConfigError(f"profile {path} does not exist; pass --profile FILE or create it")
    document = load_toml(path, MAX_PROFILE_BYTES) if data is None else parse_toml(path, data)
    root = Table(document, path)
    server = _server(root.table("server"), path)
    classes = _classes(root.table("classes"))
    breaker, breaker_models = breaker_section(root.table("breaker"))
    profile = Profile(
        source=path,
        server=server,
        batching=_batching(root.table("batching")),
        classes=classes,
        breaker=breaker,
        breaker_models=breaker_models,
        tenants=_tenants(root.table("tenants"), classes),
        devices=_devices(root.table("devices")),
        cluster=_cluster(root.table("cluster")),
    )
    root.reject_unknown()
    return profile
