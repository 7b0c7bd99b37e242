"""`infergate breaker`: the circuit breakers of the served model versions."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from infergate.cli.common import (
    JsonOption,
    TokenOption,
    UrlOption,
    console,
    print_json,
    request,
)
from infergate.cli.settings import parse_settings
from infergate.engine.breaker import TUNABLE

app = typer.Typer(help="List, tune and reset circuit breakers.", no_args_is_help=True)
FIELDS = set(TUNABLE)
STYLE = {"closed": "green", "half_open": "yellow", "open": "red"}


@app.command("list")
def list_breakers(
    url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Each model version's breaker: state, why, and what its window holds."""
    rows = request(url, token, json, lambda c: c.breakers())
    if json:
        print_json(rows)
        return
    table = Table(
        "model", "version", "state", "retry in", "window reqs", "failures", "p99 ms", "reason"
    )
    for r in rows:
        state = f"[{STYLE.get(r['state'], 'white')}]{r['state']}[/]"
        retry = f"{r['retry_after_s']:.1f} s" if r["state"] == "open" else "-"
        table.add_row(
            r["model"],
            str(r["version"]),
            state,
            retry,
            str(r["window_requests"]),
            str(r["window_failures"]),
            f"{r['window_p99_ms']:g}",
            r["reason"],
        )
    console.print(table)


@app.command("set")
def set_(
    model: Annotated[str, typer.Argument(help="Model name")],
    settings: Annotated[
        list[str],
        typer.Argument(
            help="KEY=VALUE: failure_rate, latency_p99_ms, window_seconds, min_requests, "
            "consecutive_windows, backoff_initial_s, backoff_max_s, probes"
        ),
    ],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Tune a model's breaker; applies at once and persists in the profile."""
    values = parse_settings(settings, FIELDS)
    doc = request(url, token, json, lambda c: c.set_breaker(model, values))
    if json:
        print_json(doc)
    else:
        console.print(f"breaker of {model}: " + ", ".join(f"{k} = {v}" for k, v in values.items()))


@app.command("reset")
def reset(
    model: Annotated[str, typer.Argument(help="Model name")],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Close a model's breakers now."""
    request(url, token, json, lambda c: c.reset_breaker(model))
    if json:
        print_json({"reset": model})
    else:
        console.print(f"breaker of {model}: closed")
