"""What every part of the engine shares: the clock, the event stream, the metrics and
the settings of loading. Passed down as one record instead of five arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from infergate.clock import Clock, MonotonicClock
from infergate.engine.events import EventBus
from infergate.engine.scheduling.classes import ClassTable, PriorityClass
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.engine.verify import VerifyPolicy
from infergate.metrics import Metrics


@dataclass(frozen=True)
class EngineContext:
    clock: Clock = field(default_factory=MonotonicClock)
    events: EventBus = field(default_factory=EventBus)
    metrics: Metrics = field(default_factory=Metrics)
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)
    load_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    classes: ClassTable = field(default_factory=ClassTable)
    default_class: str = "burst"  # the default tenant's class: its default and its cap
    queue_policy: QueuePolicy = field(default_factory=QueuePolicy)

    def tenant_class(self) -> PriorityClass:
        return self.classes.get(self.default_class)
