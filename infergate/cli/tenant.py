"""`infergate tenant`: who may call, how fast, and what."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from infergate.cli.common import (
    JsonOption,
    TokenOption,
    UrlOption,
    client,
    console,
    err_console,
    fail_client,
    print_json,
)
from infergate.cli.settings import parse_settings
from infergate.client import ClientError

app = typer.Typer(
    help="List, add, change and remove tenants (persisted in the profile).", no_args_is_help=True
)
FIELDS = {"class", "rps", "burst", "max_concurrency", "models", "devices", "memory_mb"}
SettingsArgument = Annotated[
    list[str] | None,
    typer.Argument(
        help='KEY=VALUE: class, rps, burst, max_concurrency, models (a,b or ["a"]), devices, '
        "memory_mb"
    ),
]


@app.command("list")
def list_tenants(
    url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Tenants with their limits and what they are using now."""
    try:
        with client(url, token) as c:
            doc = c.tenants()
    except ClientError as exc:
        fail_client(exc, json)
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
            f"{t['rps']:g}",
            f"{t['burst']:g}",
            str(t["in_flight"]),
            str(t["max_concurrency"]),
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
    try:
        with client(url, token) as c:
            doc = c.add_tenant(name, values)
    except ClientError as exc:
        fail_client(exc, json)
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
    try:
        with client(url, token) as c:
            doc = c.set_tenant(name, values)
    except ClientError as exc:
        fail_client(exc, json)
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
    try:
        with client(url, token) as c:
            c.remove_tenant(name)
    except ClientError as exc:
        fail_client(exc, json)
    if json:
        print_json({"removed": name})
    else:
        console.print(f"tenant {name} removed")
