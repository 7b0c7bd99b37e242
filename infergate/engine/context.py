"""What every part of the engine shares: the clock, the event stream, the metrics, the
tenants, and the settings a profile gives. Passed down as one record instead of many
arguments; a live profile change replaces its settings in place (Engine.apply_profile)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path

from infergate.clock import Clock, MonotonicClock
from infergate.engine.breaker import BreakerPolicy
from infergate.engine.cluster.redis_limits import SharedLimits
from infergate.engine.devices import DeviceBackend, HostBackend
from infergate.engine.events import EventBus
from infergate.engine.placement import Placer
from infergate.engine.scheduling.classes import ClassTable
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.engine.spec import ModelConfig
from infergate.engine.stats import RequestStats
from infergate.engine.tenants import Tenant, Tenants
from infergate.engine.verify import VerifyPolicy
from infergate.engine.workers.handle import WorkerHandle
from infergate.engine.workers.protocol import WorkerFactory
from infergate.metrics import Metrics


def _default_tenants() -> Tenants:
    return Tenants([Tenant("default")], (), True, MonotonicClock())


@dataclass
class EngineContext:
    clock: Clock = field(default_factory=MonotonicClock)
    events: EventBus = field(default_factory=EventBus)
    metrics: Metrics = field(default_factory=Metrics)
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)
    load_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    classes: ClassTable = field(default_factory=ClassTable)
    queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    breaker_models: dict[str, BreakerPolicy] = field(default_factory=dict)
    tenants: Tenants = field(default_factory=_default_tenants)
    devices: DeviceBackend = field(default_factory=HostBackend)
    monitor_interval_s: float = 0.5
    max_kills: int = 3  # memory kills within kill_window_s before an instance is failed
    kill_window_s: float = 60.0
    worker_nice: int = 10  # how much nicer than the gateway workers run ([devices])
    worker_factory: WorkerFactory = WorkerHandle  # tests pass in-process fakes
    store_dir: Path | None = None  # verified copies of model files; None: a temp folder
    max_concurrent_loads: int = 4  # workers loading at once ([server])
    shared_limits: SharedLimits | None = None  # [cluster]: limits shared through Redis
    load_slots: asyncio.Semaphore = field(init=False)
    # instance -> why its worker process cannot be started now (/v2/health/ready says so)
    start_failing: dict[object, str] = field(init=False, default_factory=dict)
    stats: RequestStats = field(init=False)
    placer: Placer = field(init=False)

    def __post_init__(self) -> None:
        self.stats = RequestStats(self.clock)
        self.placer = Placer(self.devices)
        self.load_slots = asyncio.Semaphore(self.max_concurrent_loads)

    def breaker_policy(self, model: str, config: ModelConfig) -> BreakerPolicy:
        """Profile defaults, then model.toml's [breaker], then the profile's
        [breaker.models.NAME] (an operator's live setting wins)."""
        if model in self.breaker_models:
            return self.breaker_models[model]
        overrides: dict[str, object] = dict(config.breaker)
        return replace(self.breaker, **overrides)  # type: ignore[arg-type]  # keys checked
