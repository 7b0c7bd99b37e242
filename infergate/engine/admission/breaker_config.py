"""The breaker's settings as a TOML table gives them, read the same way wherever they
appear: the profile's [breaker] and [breaker.models.NAME] (which the admin API and the CLI
edit), and a model.toml's [breaker]. One reader, so the bounds cannot drift apart."""

from __future__ import annotations

from infergate.engine.admission.breaker import TUNABLE
from infergate.engine.tomltable import Table
from infergate.errors import ConfigError

# The least each setting may be: a window or a backoff of 0 would spin the breaker's clock.
MINIMUMS: dict[str, float] = {
    "window_seconds": 0.1,
    "failure_rate": 0,
    "latency_p99_ms": 0,
    "consecutive_windows": 1,
    "min_requests": 1,
    "backoff_initial_s": 0.001,
    "backoff_max_s": 0.001,
    "probes": 1,
}


def breaker_keys(table: Table) -> dict[str, float]:
    """The breaker settings `table` sets, each checked for its type and bounds (an error
    names the file and key); other keys are left for the caller."""
    out: dict[str, float] = {}
    for key, kind in TUNABLE.items():
        least = MINIMUMS[key]
        value = (
            table.integer(key, None, minimum=int(least))
            if kind is int
            else table.number(key, None, minimum=least)
        )
        if value is not None:
            out[key] = value
    if out.get("failure_rate", 0) > 1:
        raise ConfigError(
            f"{table.where('failure_rate')}: expected a fraction between 0 and "
            f"1 (0.05 is 5%), got {out['failure_rate']}"
        )
    return out
