"""`infergate breaker`: the circuit breakers of the served model versions."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from infergate.cli.common import (
    AdminTokenOption,
    Format,
    FormatOption,
    JsonOption,
    UrlOption,
    answer_of,
    check_model_name,
    chosen_format,
    emit_table,
    make_app,
    print_json,
    request,
    say,
)
from infergate.cli.helptext import example
from infergate.cli.settings import parse_settings, settings_text

app = make_app("List, tune and reset circuit breakers.")
TokenOption = AdminTokenOption
STYLE = {"closed": "green", "half_open": "yellow", "open": "red"}


@app.command("list", epilog=example("infergate breaker list --format json"))
def list_breakers(
    url: UrlOption = None,
    token: TokenOption = None,
    fmt: FormatOption = Format.table,
    json: JsonOption = False,
) -> None:
    """Each model version's breaker: state, why, and what its window holds."""
    fmt = chosen_format(fmt, json)
    rows = request(url, token, fmt is Format.json, lambda c: c.breakers())
    if fmt is Format.json:
        print_json(rows)
        return
    with answer_of(url, False):
        cells = _cells(rows)
    emit_table(
        ["model", "version", "state", "retry in", "window reqs", "failures", "p99 ms", "reason"],
        cells,
        fmt,
    )


def _cells(rows: list[dict[str, Any]]) -> list[list[str | Text]]:
    return [
        [
            r["model"],
            str(r["version"]),
            Text(r["state"], style=STYLE.get(r["state"], "")),
            "-" if r["retry_after_s"] is None else f"{r['retry_after_s']:.1f} s",
            str(r["window_requests"]),
            str(r["window_failures"]),
            "-" if r["window_p99_ms"] is None else f"{r['window_p99_ms']:g}",
            r["reason"] or "",
        ]
        for r in rows
    ]


@app.command("set", epilog=example("infergate breaker set digits failure_rate=0.2"))
def set_(
    model: Annotated[str, typer.Argument(help="Model name")],
    settings: Annotated[
        list[str],
        typer.Argument(
            help="KEY=VALUE: failure_rate, latency_p99_ms, window_seconds, min_requests, "
            "consecutive_windows, backoff_initial_s, backoff_max_s, probes; KEY=null removes "
            "a setting (the profile's [breaker] applies)"
        ),
    ],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Tune a model's breaker; applies at once and persists in the profile."""
    check_model_name(model, json)
    values = parse_settings(settings, "breaker")
    doc = request(url, token, json, lambda c: c.set_breaker(model, values))
    if json:
        print_json(doc)
    else:
        say(f"breaker of {model}: {settings_text(values)}")


@app.command("reset", epilog=example("infergate breaker reset digits"))
def reset(
    model: Annotated[str, typer.Argument(help="Model name")],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Close a model's breakers now."""
    check_model_name(model, json)
    request(url, token, json, lambda c: c.reset_breaker(model))
    if json:
        print_json({"reset": model})
    else:
        say(f"breaker of {model}: closed")
