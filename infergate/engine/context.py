"""What every part of the engine shares: the clock, the event stream, the metrics, the
tenants' state, the settings fixed at start, and the live settings (`settings`, a frozen
LiveSettings). Passed down as one record instead of many arguments. A live profile
change never edits a setting in place: the engine swaps in a new LiveSettings with one
assignment (Engine.apply_settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infergate.clock import Clock, MonotonicClock
from infergate.engine.admission.tenants import Tenants
from infergate.engine.events import EventBus
from infergate.engine.lifecycle.load_slots import LoadSlots
from infergate.engine.placement.devices import DeviceBackend, HostBackend
from infergate.engine.placement.placer import Placer
from infergate.engine.repository.verify import VerifyPolicy
from infergate.engine.settings import LiveSettings
from infergate.engine.stats import RequestStats
from infergate.engine.workers.handle import WorkerHandle
from infergate.engine.workers.protocol import WorkerFactory
from infergate.metrics import Metrics

if TYPE_CHECKING:  # redis is imported only by a gateway with [cluster] (gateway.py)
    from infergate.engine.cluster.redis_limits import SharedLimits


@dataclass
class EngineContext:
    clock: Clock = field(default_factory=MonotonicClock)
    events: EventBus = field(default_factory=EventBus)
    metrics: Metrics = field(default_factory=Metrics)
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)
    load_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    settings: LiveSettings = field(default_factory=LiveSettings)  # swapped whole, never edited
    devices: DeviceBackend = field(default_factory=HostBackend)
    monitor_interval_s: float = 0.5
    max_kills: int = 3  # memory kills within kill_window_s before an instance is failed
    kill_window_s: float = 60.0
    worker_nice: int = 10  # how much nicer than the gateway workers run ([devices])
    worker_factory: WorkerFactory = WorkerHandle  # tests pass in-process fakes
    store_dir: Path | None = None  # verified copies of model files; None: a temp folder
    max_concurrent_loads: int = 4  # workers loading at once ([server])
    shared_limits: SharedLimits | None = None  # [cluster]: limits shared through Redis
    load_slots: LoadSlots = field(init=False)
    # instance -> why its worker process cannot be started now (/v2/health/ready says so)
    start_failing: dict[object, str] = field(init=False, default_factory=dict)
    stats: RequestStats = field(init=False)
    placer: Placer = field(init=False)
    tenants: Tenants = field(init=False)  # their state: buckets, counters, admissions

    def __post_init__(self) -> None:
        live = self.settings
        self.tenants = Tenants(
            list(live.tenants), live.admin_keys, live.allow_anonymous, self.clock
        )
        self.stats = RequestStats(self.clock)
        self.placer = Placer(self.devices)
        self.load_slots = LoadSlots(self.max_concurrent_loads)
