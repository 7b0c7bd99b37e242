"""A version's state, summarised from its instances, and the answer a request gets while
it is not ready."""

from __future__ import annotations

from infergate.engine.lifecycle.instance import Instance
from infergate.errors import InfergateError, ModelFailed, ModelNotReady

# The order a version's state is summarised in: the best instance wins.
_STATE_RANK = ["ready", "restarting", "loading", "failed", "stopped"]


def summary_state(instances: list[Instance]) -> str:
    """The best of the instances' states; a ready instance whose worker died is restarting."""
    states = {i.state if i.state != "ready" or i.ready else "restarting" for i in instances}
    return min(states, key=_STATE_RANK.index)


def first_reason(instances: list[Instance]) -> str | None:
    return next((i.reason for i in instances if i.reason), None)


def not_ready_error(name: str, version: int, state: str, reason: str | None) -> InfergateError:
    """503 with Retry-After while it is on its way (loading, restarting, or stopped
    while a reload replaces it); 424 without it when only a person can fix it (failed,
    or its runtime is not installed)."""
    why = f": {reason}" if reason else ""
    if state in ("loading", "restarting", "stopped"):  # stopped: being replaced
        return ModelNotReady(
            f"model {name!r} version {version} is {state}{why}. Hint: retry shortly"
        )
    if reason and "Hint:" in reason:  # its own (install X, then model load NAME): one hint
        return ModelFailed(f"model {name!r} version {version} is {state}{why}")
    return ModelFailed(
        f"model {name!r} version {version} is {state}{why}. Hint: fix the model and reload "
        f"it (infergate model status {name} shows why, infergate model load {name} retries)"
    )
