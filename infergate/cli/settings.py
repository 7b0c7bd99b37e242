"""KEY=VALUE settings from the command line, typed the way TOML would type them."""

from __future__ import annotations

from typing import Any

import orjson
import typer


def parse_settings(items: list[str], allowed: set[str]) -> dict[str, Any]:
    """`rps=50 models=["digits","mlp"] class=burst` -> {"rps": 50, ...}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE")
        if key not in allowed:
            raise typer.BadParameter(
                f"unknown setting {key!r}; known: {', '.join(sorted(allowed))}"
            )
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            value = raw  # a bare word is a string: class=burst
        if key in ("models", "devices") and isinstance(value, str):
            value = [v for v in value.split(",") if v]
        out[key] = value
    return out
