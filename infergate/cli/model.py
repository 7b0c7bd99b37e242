"""`infergate model`: what the server holds and how each model is doing."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from infergate.cli.common import (
    JsonOption,
    TokenOption,
    UrlOption,
    client,
    console,
    fail_client,
    print_json,
    styled_state,
)
from infergate.client import ClientError

app = typer.Typer(help="List models and inspect their state.", no_args_is_help=True)


def _instances(version: dict[str, Any]) -> str:
    ready = sum(1 for i in version["instances"] if i["state"] == "ready")
    return f"{ready}/{len(version['instances'])}"


@app.command("list")
def list_models(url: UrlOption = None, token: TokenOption = None, json: JsonOption = False) -> None:
    """List every model in the repository with its versions and state."""
    try:
        with client(url, token) as c:
            models = c.models()
    except ClientError as exc:
        fail_client(exc, json)
    if json:
        print_json(models)
        return
    table = Table("model", "version", "state", "instances", "platform", "reason")
    for model in models:
        if not model["versions"]:
            table.add_row(
                model["name"], "-", styled_state(model["state"]), "-", "-", model["reason"] or ""
            )
        for v in model["versions"]:
            marker = "*" if v["version"] == model["default_version"] else ""
            table.add_row(
                model["name"],
                f"{v['version']}{marker}",
                styled_state(v["state"]),
                _instances(v),
                v["platform"],
                v["reason"] or "",
            )
    console.print(table)


@app.command("status")
def status(
    name: Annotated[str, typer.Argument(help="Model name")],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """One model in detail: versions, instances with their PIDs and devices, tensors."""
    try:
        with client(url, token) as c:
            model = c.model(name)
    except ClientError as exc:
        fail_client(exc, json)
    if json:
        print_json(model)
        return
    console.print(
        f"[bold]{model['name']}[/]  {styled_state(model['state'])}"
        + (f"  default version {model['default_version']}" if model["default_version"] else "")
    )
    if model["reason"]:
        console.print(f"  reason: {model['reason']}", highlight=False)
    for v in model["versions"]:
        console.print(
            f"\n version {v['version']}  {styled_state(v['state'])}  {v['platform']}  {v['path']}",
            highlight=False,
        )
        table = Table("instance", "state", "pid", "device", "restarts", "reason")
        for i in v["instances"]:
            table.add_row(
                str(i["index"]),
                styled_state(i["state"]),
                str(i["pid"] or "-"),
                i["device"] or "-",
                str(i["restarts"]),
                i["reason"] or "",
            )
        console.print(table)
        tensors = Table("tensor", "name", "datatype", "shape")
        for kind in ("inputs", "outputs"):
            for t in v[kind]:
                tensors.add_row(kind[:-1], t["name"], t["datatype"], str(t["shape"]))
        console.print(tensors)
