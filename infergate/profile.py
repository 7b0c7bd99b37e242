"""The profile: server settings, batching defaults, priority classes, breaker
defaults (and per-model overrides), and tenants. Unknown sections and keys are named, not
ignored; every error names the file, the key and what was expected."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from infergate.engine.admission.breaker import BreakerPolicy
from infergate.engine.admission.breaker_config import breaker_keys
from infergate.engine.admission.tenants import DEFAULT_TENANT, Tenant
from infergate.engine.cluster.settings import FAIL_MODES, ClusterSettings
from infergate.engine.scheduling.classes import DEFAULT_CLASSES, ClassTable, PriorityClass
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.engine.settings import LiveSettings
from infergate.engine.tomltable import Table, load_toml
from infergate.errors import ConfigError

DEFAULT_PROFILE = Path("profiles/default.toml")
_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


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
    admin_keys: tuple[str, ...] = ()
    allow_anonymous: bool = True
    # Triton's default is strict (not ready while any model failed to load). A gateway
    # serves many tenants: one tenant's broken model must not pull the whole pod out of
    # its load balancer, so here readiness means "the gateway serves" unless asked.
    strict_readiness: bool = False
    max_concurrent_loads: int = 4  # worker processes loading a model at once
    # The HTTP edge (see server/http_protocol.py): what one connection may take.
    max_header_kb: float = 64.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 2048


@dataclass(frozen=True)
class DeviceSettings:
    backend: str = "auto"  # auto (NVML when a GPU answers, else host), host, nvml, simulated
    simulated_mb: tuple[float, ...] = (16384.0, 16384.0)  # the simulated GPUs' sizes
    monitor_interval_s: float = 0.5
    max_kills: int = 3
    kill_window_s: float = 60.0
    # Worker processes run this much nicer than the gateway: on a busy CPU the gateway's
    # event loop (every request's way in and out) goes before model compute.
    worker_nice: int = 10


def _devices(table: Table) -> DeviceSettings:
    d = DeviceSettings()
    sizes = table.array("simulated_mb", list(d.simulated_mb))
    if not sizes or not all(isinstance(x, (int, float)) and x > 0 for x in sizes):
        raise ConfigError(
            f"{table.where('simulated_mb')}: expected a list of positive sizes "
            "in MB, one per simulated GPU"
        )
    settings = DeviceSettings(
        backend=table.string("backend", d.backend, choices=("auto", "host", "nvml", "simulated")),
        simulated_mb=tuple(float(x) for x in sizes),
        monitor_interval_s=table.number("monitor_interval_s", d.monitor_interval_s, minimum=0.01),
        max_kills=table.integer("max_kills", d.max_kills, minimum=1),
        kill_window_s=table.number("kill_window_s", d.kill_window_s, minimum=0.1),
        worker_nice=table.integer("worker_nice", d.worker_nice, minimum=0, maximum=19),
    )
    table.reject_unknown()
    return settings


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
    d = ClusterSettings()
    url = table.string("redis_url", d.redis_url)
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{table.where('redis_url')}: expected a Redis URL such as "
            f'"redis://127.0.0.1:6379/0" (or rediss://, unix://), got {url!r}'
        )
    mode = table.string("fail_mode", d.fail_mode, choices=FAIL_MODES)
    settings = ClusterSettings(
        redis_url=url,
        fail_mode="open" if mode == "open" else "closed" if mode == "closed" else "local",
        socket_timeout_ms=table.number("socket_timeout_ms", d.socket_timeout_ms, minimum=1),
        connect_timeout_ms=table.number("connect_timeout_ms", d.connect_timeout_ms, minimum=1),
        lease_ttl_s=table.number("lease_ttl_s", d.lease_ttl_s, minimum=0.3),
        replicas=table.integer("replicas", d.replicas, minimum=1),
        key_prefix=table.string("key_prefix", d.key_prefix),
    )
    table.reject_unknown()
    return settings


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
    names = table.names()
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


def _key_hashes(table: Table, key: str) -> tuple[str, ...]:
    hashes = table.array(key, [])
    for value in hashes:
        if not isinstance(value, str) or not _KEY_HASH.match(value):
            raise ConfigError(
                f'{table.where(key)}: expected "sha256:<64 hex digits>" (the hash of a key, '
                f"never the key), got {value!r}. Hint: infergate tenant add makes keys"
            )
    return tuple(hashes)


def _breaker(table: Table, base: BreakerPolicy) -> BreakerPolicy:
    return replace(base, **breaker_keys(table))  # type: ignore[arg-type]  # keys checked


def breaker_section(table: Table) -> tuple[BreakerPolicy, dict[str, BreakerPolicy]]:
    """[breaker] defaults and [breaker.models.NAME] overrides on top of them."""
    defaults = _breaker(table, BreakerPolicy())
    models = table.table("models")
    overrides = {}
    for name in models.names():
        override = models.table(name)
        overrides[name] = _breaker(override, defaults)
        override.reject_unknown()
    table.reject_unknown()
    return defaults, overrides


def default_burst(rps: float) -> float:
    """A tenant that sets rps but no burst may send two seconds' worth at once."""
    return max(1.0, 2.0 * rps) if math.isfinite(rps) else rps


def _tenants(table: Table, classes: tuple[PriorityClass, ...]) -> tuple[Tenant, ...]:
    names = table.names() or [DEFAULT_TENANT]
    class_names = [c.name for c in classes]
    out = []
    for name in names:
        entry = table.table(name)
        fallback = "burst" if "burst" in class_names else class_names[-1]
        cls = entry.string("class", fallback)
        if cls not in class_names:
            raise ConfigError(
                f"{entry.where('class')}: {cls!r} is not a class; the profile "
                f"defines {', '.join(class_names)}"
            )
        d = Tenant(name)
        rps = entry.number("rps", d.rps, minimum=0)
        models = entry.array("models", list(d.models))
        devices = entry.array("devices", list(d.devices))
        for key, values in (("models", models), ("devices", devices)):
            if not all(isinstance(v, str) for v in values):
                raise ConfigError(f"{entry.where(key)}: expected a list of strings")
        out.append(
            Tenant(
                name=name,
                cls=cls,
                rps=rps,
                burst=entry.number("burst", default_burst(rps), minimum=1),
                max_concurrency=entry.integer("max_concurrency", d.max_concurrency, minimum=1),
                models=tuple(models),
                devices=tuple(devices),
                memory_mb=entry.integer("memory_mb", d.memory_mb, minimum=1),
                api_keys=_key_hashes(entry, "api_keys"),
                weight=entry.number("weight", d.weight, minimum=0.001),
            )
        )
        entry.reject_unknown()
    return tuple(out)


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
        admin_keys=_key_hashes(server, "admin_keys"),
        allow_anonymous=server.boolean("allow_anonymous", defaults.allow_anonymous),
        strict_readiness=server.boolean("strict_readiness", defaults.strict_readiness),
        max_concurrent_loads=server.integer(
            "max_concurrent_loads", defaults.max_concurrent_loads, minimum=1, maximum=256
        ),
        max_header_kb=server.number("max_header_kb", defaults.max_header_kb, minimum=1),
        header_timeout_s=server.number("header_timeout_s", defaults.header_timeout_s, minimum=0.05),
        body_timeout_s=server.number("body_timeout_s", defaults.body_timeout_s, minimum=0.05),
        keep_alive_timeout_s=server.number(
            "keep_alive_timeout_s", defaults.keep_alive_timeout_s, minimum=0.05
        ),
        max_connections=server.integer("max_connections", defaults.max_connections, minimum=1),
    )
    if settings.require_signed_models and not settings.trusted_keys:
        raise ConfigError(
            f"{path}: server.require_signed_models is true but server.trusted_keys is empty; "
            "add the .pub files of the keys you sign with (infergate model keygen makes one)"
        )
    server.reject_unknown()
    classes = _classes(root.table("classes"))
    breaker, breaker_models = breaker_section(root.table("breaker"))
    profile = Profile(
        source=path,
        server=settings,
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
