"""KEY=VALUE settings from the command line, typed the way TOML would type them; the keys
a tenant or a breaker takes, and which of them are lists, come from the profile's
declarations (infergate/settings/edits.py). `KEY=null` removes a setting, so its default
applies again (no rate limit, for rps)."""

from __future__ import annotations

from typing import Any, Literal

import orjson
import typer


def parse_settings(items: list[str], what: Literal["tenant", "breaker"]) -> dict[str, Any]:
    """`rps=50 models=["digits","mlp"] class=burst` -> {"rps": 50, ...}."""
    # Imported here: pydantic stays out of the CLI's start-up (only these commands need it).
    from infergate.settings.edits import editable, is_list

    allowed = editable(what)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE")
        if key not in allowed:
            raise typer.BadParameter(f"unknown setting {key!r}; known: {', '.join(allowed)}")
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            value = raw  # a bare word is a string: class=burst
        if is_list(what, key) and isinstance(value, str):
            value = [v for v in value.split(",") if v]
        out[key] = value
    return out
