"""A version's circuit breaker: made with its metric and events, what counts against it,
and the answer while it is open."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from infergate.engine.admission.breaker import Admission, Breaker
from infergate.engine.context import EngineContext
from infergate.engine.repository.spec import ModelConfig
from infergate.errors import CircuitOpen, InfergateError

if TYPE_CHECKING:
    from infergate.engine.lifecycle.instance import Instance

BREAKER_STATES = ["closed", "half_open", "open"]  # the gauge's values: 0, 1, 2


def version_breaker(
    name: str, version: int, config: ModelConfig, context: EngineContext
) -> Breaker:
    """The version's breaker, under the profile's policy and model.toml's overrides; each
    change of state is a gauge value and an event."""
    gauge = context.metrics.breaker_state.labels(name, str(version))

    def changed(state: str, reason: str) -> None:
        gauge.set(BREAKER_STATES.index(state))
        context.events.publish(f"breaker_{state}", name, reason, version)

    def cut_off(tenant: Hashable, reason: str, backoff_s: float) -> None:
        context.events.publish(
            "breaker_tenant_cut_off",
            name,
            f"tenant {tenant!r} refused for {backoff_s:g} s: {reason}",
            version,
            tenant=tenant,
        )

    # The gauge is set when the version starts serving (`show_state`), not here: a
    # replacement built while the old version serves must not show its open breaker closed.
    policy = context.settings.breaker_policy(name, config)
    return Breaker(policy, context.clock, changed, cut_off)


def show_state(name: str, version: int, breaker: Breaker, context: EngineContext) -> None:
    """The version now serves: its gauge shows its breaker from now on (a quiet closed
    breaker too, so that a scrape can tell it from a missing one)."""
    gauge = context.metrics.breaker_state.labels(name, str(version))
    gauge.set(BREAKER_STATES.index(breaker.state))


def hide_state(name: str, version: int, context: EngineContext) -> None:
    """The version no longer serves (retired, unloaded): its gauge goes, so that a scrape
    does not show a breaker for a version that is gone."""
    with contextlib.suppress(KeyError):  # (a version that never served never showed one)
        context.metrics.breaker_state.remove(name, str(version))


def judge_worker_deaths(instances: Sequence[Instance], breaker: Breaker) -> None:
    """The breaker judges the workers of these instances that a tenant's lone requests end
    (a query of death, Breaker.worker_ended); the version wires them once it made both."""
    for instance in instances:
        instance.on_ended_by = breaker.worker_ended


def record_failure(
    breaker: Breaker, admission: Admission, exc: BaseException, tenant: Hashable = None
) -> None:
    """A request of `tenant` that was let through raised. The breaker judges the model:
    its own failures count; load (queue deadlines, shedding), the client's mistakes and
    the gateway's bugs do not, and a probe that did not reach the model only ends."""
    if isinstance(exc, InfergateError) and exc.model_fault:
        breaker.record(admission, False, None, tenant, exc.shared)
    elif admission == "probe":
        breaker.record(admission, True, None, tenant)


def circuit_open(name: str, version: int, breaker: Breaker, tenant: Hashable = None) -> CircuitOpen:
    """The answer while the breaker refuses `tenant`'s requests."""
    wait = breaker.retry_after(tenant)
    own = breaker.cut_off(tenant) if breaker.state == "closed" else None
    if own is not None:
        return CircuitOpen(
            f"model {name!r} version {version} is cut off for tenant {tenant!r} by its "
            f"circuit breaker ({own}); retry in {wait:.1f} s. Hint: check what this "
            f"tenant sends; infergate breaker list shows it, infergate breaker reset {name} "
            "lets it in again",
            wait,
        )
    return CircuitOpen(
        f"model {name!r} version {version} is cut off by its circuit "
        f"breaker ({breaker.reason}); retry in {wait:.1f} s. Hint: infergate "
        f"breaker list shows it, infergate breaker reset {name} closes it",
        wait,
    )
