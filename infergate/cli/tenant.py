"""`infergate tenant`: who may call, how fast, and what."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from infergate.cli.common import (
    AdminTokenOption,
    Format,
    FormatOption,
    JsonOption,
    UrlOption,
    answer_of,
    check_tenant_in_path,
    check_tenant_name,
    chosen_format,
    emit_table,
    make_app,
    print_json,
    request,
    say,
)
from infergate.cli.helptext import example
from infergate.cli.settings import parse_settings, settings_text
from infergate.client_errors import escape_controls

app = make_app("List, add, change and remove tenants (persisted in the profile).")
TokenOption = AdminTokenOption
SettingsArgument = Annotated[
    list[str] | None,
    typer.Argument(
        help='KEY=VALUE: class, rps, burst, max_concurrency, models (a,b or ["a"]), devices, '
        "memory_mb, weight; KEY=null removes a setting (its default applies)"
    ),
]
FLOATS = ("rps", "burst", "tokens")
INTS = ("max_concurrency", "memory_mb", "keys", "in_flight", "admitted")


def normalized(tenant: dict[str, Any]) -> dict[str, Any]:
    """One type per field whatever the profile wrote (rps = 50 or 50.0): numbers that can
    be fractional are floats, counts are integers, absent values null."""
    out = dict(tenant)
    for k in FLOATS:
        if isinstance(out.get(k), (int, float)):
            out[k] = float(out[k])
    for k in INTS:
        if isinstance(out.get(k), (int, float)):
            out[k] = int(out[k])
    return out


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


@app.command("list", epilog=example("infergate tenant list --format tsv"))
def list_tenants(
    url: UrlOption = None,
    token: TokenOption = None,
    fmt: FormatOption = Format.table,
    json: JsonOption = False,
) -> None:
    """Tenants with their limits and what they are using now."""
    fmt = chosen_format(fmt, json)
    doc = request(url, token, fmt is Format.json, lambda c: c.tenants())
    tenants = [normalized(t) for t in doc["tenants"]]
    if doc.get("profile_error"):  # on stderr, so --json stays one array
        rejected = escape_controls(str(doc["profile_error"]))
        say(f"warning: the profile's last edit was rejected: {rejected}", err=True)
    if fmt is Format.json:
        print_json(tenants)
        return
    with answer_of(url, False):
        rows = _rows(tenants)
    emit_table(
        [
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
        ],
        rows,
        fmt,
    )


def _rows(tenants: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            t["name"],
            t["class"],
            _num(t["rps"]),
            _num(t["burst"]),
            str(t["in_flight"]),
            _num(t["max_concurrency"]),
            ",".join(t["models"]),
            str(t["keys"]),
            str(t["admitted"]),
            str(t["rate_limited"] + t["over_concurrency"]),
            str(t["forbidden"]),
        ]
        for t in tenants
    ]


@app.command("add", epilog=example("infergate tenant add acme rps=50 models=digits"))
def add(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    settings: SettingsArgument = None,
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Add a tenant and print its API key (shown this once; only its hash is stored)."""
    check_tenant_name(name, json)
    values = parse_settings(settings or [], "tenant")
    doc = request(url, token, json, lambda c: c.add_tenant(name, values))
    if json:
        print_json(doc)
        return
    with answer_of(url, False):
        key = doc["api_key"]
        if not isinstance(key, str):
            raise TypeError(f"api_key is {key!r}, not a string")
    say(f"tenant {name} added. API key (shown once, store it now):")
    print(escape_controls(key))


@app.command("set", epilog=example("infergate tenant set acme rps=100 'models=[\"dig*\"]'"))
def set_(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    settings: SettingsArgument = None,
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Change a tenant's limits; applies at once and persists in the profile."""
    check_tenant_in_path(name, json)
    values = parse_settings(settings or [], "tenant")
    if not values:
        raise typer.BadParameter("give at least one KEY=VALUE")
    doc = request(url, token, json, lambda c: c.set_tenant(name, values))
    if json:
        print_json(doc)
        return
    say(f"tenant {name}: {settings_text(values)}")


@app.command("remove", epilog=example("infergate tenant remove acme"))
def remove(
    name: Annotated[str, typer.Argument(help="Tenant name")],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Remove a tenant; its keys stop working at once."""
    check_tenant_in_path(name, json)
    request(url, token, json, lambda c: c.remove_tenant(name))
    if json:
        print_json({"removed": name})
    else:
        say(f"tenant {name} removed")
