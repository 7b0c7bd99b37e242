"""`infergate tenant`: who may call, how fast, and what."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from infergate.cli.common import (
    JsonOption,
    TokenOption,
    UrlOption,
    console,
    err_console,
    print_json,
    request,
)
from infergate.cli.settings import parse_settings
from infergate.engine.tenants import SETTABLE

app = typer.Typer(
    help="List, add, change and remove tenants (persisted in the profile).", no_args_is_help=True
)
FIELDS = set(SETTABLE)
SettingsArgument = Annotated[
    list[str] | None,
    typer.Argument(
        help='KEY=VALUE: class, rps, burst, max_concurrency, models (a,b or ["a"]), devices, '
        "memory_mb"
    ),
]


def _limit(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


@app.command("list")
def list_tenants(
    url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Tenants with their limits and what they are using now."""
    doc = request(url, token, json, lambda c: c.tenants())
    if json:
        print_json(doc)
        return
    table = Table(
        "tenant",
        "class",
        "rps",
        "burst",
        "in flight",
        "max conc.",
        "models",
        "keys",
        "admitted",
        "429",
        "403",
    )
    for t in doc["tenants"]:
        table.add_row(
            t["name"],
            t["class"],
            _limit(t["rps"]),
            _limit(t["burst"]),
            str(t["in_flight"]),
            _limit(t["max_concurrency"]),
            ",".join(t["models"]),
            str(t["keys"]),
            str(t["admitted"]),
            str(t["rate_limited"] + t["over_concurrency"]),
            str(t["forbidden"]),
        )
    console.print(table)
    if doc.get("profile_error"):
        err_console.print(
            f"[red]the profile's last edit was rejected:[/] {doc['profile_error']}", highlight=False
        )


@app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    settings: SettingsArgument = None,
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Add a tenant and print its API key (shown this once; only its hash is stored)."""
    values = parse_settings(settings or [], FIELDS)
    doc = request(url, token, json, lambda c: c.add_tenant(name, values))
    if json:
        print_json(doc)
        return
    console.print(f"tenant {name} added. API key (shown once, store it now):")
    print(doc["api_key"])


@app.command("set")
def set_(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    settings: SettingsArgument = None,
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Change a tenant's limits; applies at once and persists in the profile."""
    values = parse_settings(settings or [], FIELDS)
    if not values:
        raise typer.BadParameter("give at least one KEY=VALUE")
    doc = request(url, token, json, lambda c: c.set_tenant(name, values))
    if json:
        print_json(doc)
        return
    console.print(f"tenant {name}: " + ", ".join(f"{k} = {v}" for k, v in values.items()))


@app.command("remove")
def remove(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Remove a tenant; its keys stop working at once."""
    request(url, token, json, lambda c: c.remove_tenant(name))
    if json:
        print_json({"removed": name})
    else:
        console.print(f"tenant {name} removed")
