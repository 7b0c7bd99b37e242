"""The settings a live profile change may change while serving, as one frozen record.

The engine owns this type; infergate/profile.py builds it (`Profile.live_settings`), so the
engine never reads a profile. A change builds a new record and the engine swaps it in with
one assignment (`Engine.apply_settings`): a request reads either the old record or the
new one, never half of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from infergate.engine.admission.breaker import BreakerPolicy
from infergate.engine.admission.tenants import DEFAULT_TENANT, Tenant
from infergate.engine.repository.spec import ModelConfig
from infergate.engine.scheduling.classes import ClassTable
from infergate.engine.scheduling.queue import QueuePolicy


def _frozen(policies: Mapping[str, BreakerPolicy]) -> Mapping[str, BreakerPolicy]:
    return MappingProxyType(dict(policies))


@dataclass(frozen=True)
class LiveSettings:
    classes: ClassTable = field(default_factory=ClassTable)
    queue_policy: QueuePolicy = field(default_factory=QueuePolicy)  # versions loaded from now
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)  # the profile's [breaker]
    breaker_models: Mapping[str, BreakerPolicy] = field(default_factory=dict)
    tenants: tuple[Tenant, ...] = (Tenant(DEFAULT_TENANT),)
    admin_keys: tuple[str, ...] = ()
    allow_anonymous: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "breaker_models", _frozen(self.breaker_models))

    def breaker_policy(self, model: str, config: ModelConfig) -> BreakerPolicy:
        """Profile defaults, then model.toml's [breaker], then the profile's
        [breaker.models.NAME] (an operator's live setting wins)."""
        if model in self.breaker_models:
            return self.breaker_models[model]
        overrides: dict[str, object] = dict(config.breaker)
        return replace(self.breaker, **overrides)  # type: ignore[arg-type]  # keys checked
