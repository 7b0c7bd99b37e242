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
        if key in out:
            raise typer.BadParameter(f"{key} is given twice; give each setting once")
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            value = raw  # a bare word is a string: class=burst
        if is_list(what, key) and isinstance(value, str):
            value = [v for v in value.split(",") if v]
            if not value:  # `models=` reads as "clear it", but an empty list allows none
                raise typer.BadParameter(
                    f"{item!r} is an empty list: {key}=[] says none (say so that way), "
                    f"{key}=null removes the setting (its default applies)"
                )
        out[key] = value
    return out


def settings_text(values: dict[str, Any]) -> str:
    """`rps = 50, models = ["digits"], burst = null (its default applies)`: each value as
    the JSON it was sent as."""
    return ", ".join(
        f"{k} = null (its default applies)" if v is None else f"{k} = {orjson.dumps(v).decode()}"
        for k, v in values.items()
    )
