"""The profile's settings, declared once: each section's keys with their types, defaults,
bounds and help. infergate/profile.py reads the file with them, the admin API's edits are
checked by them (the edited file is read again), the CLI takes its KEY=VALUE names from
them, and the README's reference is generated from them (infergate/settings/reference.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from infergate.engine.admission.breaker import BreakerPolicy
from infergate.engine.admission.tenants import Tenant
from infergate.engine.cluster.settings import ClusterSettings, FailMode
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.settings.declare import Section, setting

# Defaults the engine's records hold are taken from them, so each is written once; the
# profile's own ([server], [devices]) are written here.
_BREAKER = BreakerPolicy()
_QUEUE = QueuePolicy()
_TENANT = Tenant("")
_CLUSTER = ClusterSettings()
KEY_HASH = r"^sha256:[0-9a-f]{64}$"
KeyHash = Annotated[str, StringConstraints(pattern=KEY_HASH)]
_KEY_HASHES = '"sha256:<64 hex digits>" (the hash of a key, never the key)'
_KEYS_HINT = "infergate tenant add makes keys"


class ServerSection(Section):
    """[server]: read at start; a change needs a restart (the event stream says so)."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8000, "port to bind (0: any free port)", ge=0, le=65535)
    models: str = setting(
        "models",
        "the model repository; a relative path is taken from the folder above a profiles/ "
        "folder the profile is in, else from the working directory",
    )
    max_request_mb: float = setting(
        64.0,
        "a larger request body gets 413; a request holds at most one BYTES element (and "
        "its JSON one array, object or string) per 64 bytes of it",
        ge=0.001,
        unit="MB",
    )
    max_bodies_mb: float = setting(
        256.0,
        "request bodies over 64 KB held at once, at most half by one tenant (so at least "
        "twice max_request_mb); more wait unread, tenants in turn (503 after 10 s)",
        ge=1,
        unit="MB",
    )
    load_timeout_s: float = setting(
        120.0,
        "a worker that has not loaded and warmed up by then is killed (a remote model's "
        "load asks its silent upstreams again for at most 10 s)",
        ge=1,
        unit="s",
    )
    model_control: Literal["poll", "explicit"] = setting(
        "poll", "poll: watch the models folder; explicit: only API calls load"
    )
    file_stable_s: float = setting(
        1.0, "a changed file is acted on once it has been still this long", ge=0.05, unit="s"
    )
    drain_timeout_s: float = setting(
        30.0,
        "how long a replaced version (or, on SIGTERM, the gateway) may finish its in-flight "
        "requests",
        ge=0,
        unit="s",
    )
    require_signed_models: bool = setting(False, "only files signed by one of trusted_keys load")
    trusted_keys: list[str] = setting(
        [],
        ".pub files (relative to the profile's folder) whose signatures count",
        expected="paths to .pub files",
        hint="infergate model keygen makes a key pair",
    )
    admin_keys: list[KeyHash] = setting(
        [],
        "key hashes for /admin and the repository API (none: open, loopback only)",
        expected=_KEY_HASHES,
        hint=_KEYS_HINT,
    )
    allow_anonymous: bool = setting(True, "keyless requests are the default tenant")
    private_models: bool = setting(
        False,
        "true: model metadata, readiness, config and stats need a key that may use the "
        "model, and /metrics an admin key (needs admin_keys)",
    )
    # Triton's default is strict (not ready while any model failed to load). A gateway
    # serves many tenants: one tenant's broken model must not pull the whole pod out of
    # its load balancer, so here readiness means "the gateway serves" unless asked.
    strict_readiness: bool = setting(
        False, "true: /v2/health/ready is 503 while any model failed to load"
    )
    # Triton's own examples check that GET /v2 names "triton": a drop-in answers that, as
    # browsers still say "Mozilla". Set "infergate" where no client checks it.
    server_name: str = setting(
        "triton", 'the name GET /v2 answers (Triton\'s clients check for "triton")'
    )
    max_concurrent_loads: int = setting(
        4,
        "worker processes loading (spawn, load, warm up) at once; the rest wait (restarts of "
        "serving workers first, and a quarter more of them)",
        ge=1,
        le=256,
    )
    max_header_kb: float = setting(64.0, "request line + headers; larger gets 431", ge=1, unit="KB")
    header_timeout_s: float = setting(
        10.0, "from a request's first byte to the end of its headers; else 408", ge=0.05, unit="s"
    )
    body_timeout_s: float = setting(
        60.0, "from the end of the headers to the end of the body; else 408", ge=0.05, unit="s"
    )
    keep_alive_timeout_s: float = setting(
        5.0, "a connection idle this long is closed", ge=0.05, unit="s"
    )
    max_connections: int = setting(
        2048, "open connections; past it a new one gets 503 + Retry-After", ge=1
    )
    max_connections_per_client: int = setting(
        0,
        "open connections from one client address; past it a new one gets 503 + "
        "Retry-After (0: no limit of its own; behind a proxy every client has its address)",
        ge=0,
    )
    fronts: int = setting(
        0,
        "front processes doing the HTTP side beside the engine's process, for more small "
        "requests a second on several cores (0: one process does all)",
        ge=0,
        le=64,
    )


class BatchingSection(Section):
    """[batching]: dynamic batching. The profile's are the defaults; a model.toml's
    [batching] overrides them, key by key, for that model."""

    max_batch_size: int = setting(
        _QUEUE.max_batch_size,
        "rows merged into one run when the model has a batch dimension; 0: off",
        ge=0,
    )
    max_queue_delay_ms: float = setting(
        _QUEUE.max_delay_s * 1000.0,
        "how long the oldest request may wait for a batch to fill, and only while another "
        "batch of the model runs or its callers were just answered (a lone client never "
        "waits)",
        ge=0,
        unit="ms",
    )
    max_queue_size: int = setting(
        _QUEUE.max_queue_size,
        "requests waiting per model; past it 503 (lower classes shed first)",
        ge=1,
    )


class ClassSection(Section):
    """[classes.NAME]: a priority class (none given: realtime, burst, batch)."""

    rank: int = setting(..., "0 is the most urgent", ge=0)
    deadline_ms: float = setting(
        ..., "a request not started by then gets 504 and is never run", ge=0.1, unit="ms"
    )


class BreakerSection(Section):
    """[breaker]: circuit breakers. The profile's [breaker] holds the defaults for every
    model version; a model.toml's [breaker] overrides them, key by key, for that model; the
    profile's [breaker.models.NAME] (what `infergate breaker set` writes) wins over both."""

    window_seconds: float = setting(
        _BREAKER.window_seconds,
        "sliding window, in 10 buckets, evaluated at each bucket's end",
        ge=0.1,
        unit="s",
    )
    failure_rate: float = setting(
        _BREAKER.failure_rate,
        "open when more than this share fails (given min_requests)",
        ge=0,
        le=1,
        expected="a fraction between 0 and 1 (0.05 is 5%)",
    )
    latency_p99_ms: float = setting(
        _BREAKER.latency_p99_ms, "... or when the window's p99 is above this", ge=0, unit="ms"
    )
    consecutive_windows: int = setting(
        _BREAKER.consecutive_windows, "... this many evaluations in a row", ge=1
    )
    min_requests: int = setting(
        _BREAKER.min_requests, "requests a window needs before its failure rate counts", ge=1
    )
    backoff_initial_s: float = setting(
        _BREAKER.backoff_initial_s,
        "open this long, doubling on each failed probe",
        ge=0.001,
        unit="s",
    )
    backoff_max_s: float = setting(
        _BREAKER.backoff_max_s,
        "... up to this (a tenant cut off alone: doubling on to 600 s)",
        ge=0.001,
        unit="s",
    )
    probes: int = setting(
        _BREAKER.probes, "half-open: this many requests go through; all must succeed", ge=1
    )


class TenantSection(Section):
    """[tenants.NAME]: who may call, how fast, and what (none given: one `default`)."""

    cls: str | None = Field(
        None,
        alias="class",
        description="the highest class it may ask for, and its default "
        "(default: burst when defined, else the last class)",
        json_schema_extra={"unit": ""},
    )
    rps: float | None = setting(
        None, "token bucket refill rate (none: no limit)", ge=0, unit="req/s"
    )
    burst: float | None = setting(
        None, "token bucket size (default: two seconds' worth of rps)", ge=1
    )
    max_concurrency: int | None = setting(
        None, "requests in flight at once (none: no limit)", ge=1, le=1_000_000
    )
    models: list[str] = setting(list(_TENANT.models), "glob patterns of the models it may use")
    devices: list[str] = setting(
        list(_TENANT.devices), 'devices its models may use: "auto" (any), "cpu", "cuda:1"...'
    )
    memory_mb: int = setting(
        _TENANT.memory_mb,
        "the memory all its models' instances may reserve together; set, it also bounds what "
        "its models without memory_mb use together",
        ge=1,
        unit="MB",
    )
    api_keys: list[KeyHash] = setting(
        [], "hashes of its API keys", expected=_KEY_HASHES, hint=_KEYS_HINT
    )
    weight: float = setting(
        _TENANT.weight, "its share of a model's queue against tenants of the same class", ge=0.001
    )


class DevicesSection(Section):
    """[devices]: how devices are seen and guarded (restart to change)."""

    backend: Literal["auto", "host", "nvml", "simulated"] = setting(
        "auto", "auto: NVML when a GPU answers, else the host (CPU and RAM)"
    )
    simulated_mb: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [16384.0, 16384.0],
        min_length=1,
        description="the simulated GPUs' sizes, for backend = simulated",
        json_schema_extra={
            "unit": "MB",
            "expected": "a list of positive sizes in MB, one per simulated GPU",
        },
    )
    monitor_interval_s: float = setting(
        0.5, "how often device memory is sampled", ge=0.01, unit="s"
    )
    max_kills: int = setting(3, "memory kills within kill_window_s before a model is failed", ge=1)
    kill_window_s: float = setting(60.0, "the window max_kills counts in", ge=0.1, unit="s")
    # Worker processes run this much nicer than the gateway: on a busy CPU the gateway's
    # event loop (every request's way in and out) goes before model compute.
    worker_nice: int = setting(
        10, "how much nicer worker processes run than the gateway", ge=0, le=19
    )


class ClusterSection(Section):
    """[cluster]: tenant limits shared through Redis by every replica (restart to change)."""

    redis_url: Annotated[str, StringConstraints(pattern=r"^$|^(redis|rediss|unix)://")] = setting(
        _CLUSTER.redis_url,
        "Redis URL; empty: limits per process",
        expected='a Redis URL such as "redis://127.0.0.1:6379/0" (or rediss://, unix://)',
    )
    # Without Redis: "local" enforces this replica's share of each limit, "open" admits,
    # "closed" refuses (503).
    fail_mode: FailMode = setting(
        _CLUSTER.fail_mode, "without Redis: local (this replica's share), open, or closed (503)"
    )
    # redis-py waits 5 s by default, with retries; a limit check must never cost that.
    socket_timeout_ms: float = setting(
        _CLUSTER.socket_timeout_ms,
        "the most a request waits for Redis (no retries)",
        ge=1,
        unit="ms",
    )
    connect_timeout_ms: float = setting(
        _CLUSTER.connect_timeout_ms, "connecting to Redis", ge=1, unit="ms"
    )
    lease_ttl_s: float = setting(
        _CLUSTER.lease_ttl_s,
        "a dead replica's concurrency slots are free within this",
        ge=0.3,
        unit="s",
    )
    replicas: int = setting(
        _CLUSTER.replicas, "floor of the replica count that divides the local share", ge=1
    )
    key_prefix: str = setting(_CLUSTER.key_prefix, "prefix of the Redis keys")
