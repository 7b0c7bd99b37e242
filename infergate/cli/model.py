"""`infergate model`: what the server holds and how each model is doing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from infergate.cli.common import (
    EXIT_USAGE,
    JsonOption,
    TokenOption,
    UrlOption,
    console,
    fail,
    print_json,
    request,
    styled_state,
)
from infergate.client import Client

app = typer.Typer(help="List, inspect, load, unload and sign models.", no_args_is_help=True)


def _instances(version: dict[str, Any]) -> str:
    ready = sum(1 for i in version["instances"] if i["state"] == "ready")
    return f"{ready}/{len(version['instances'])}"


@app.command("list")
def list_models(url: UrlOption = None, token: TokenOption = None, json: JsonOption = False) -> None:
    """List every model in the repository with its versions and state."""
    models = request(url, token, json, lambda c: c.models())
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
    model = request(url, token, json, lambda c: c.model(name))
    if json:
        print_json(model)
        return
    console.print(
        f"[bold]{model['name']}[/]  {styled_state(model['state'])}"
        + (f"  default version {model['default_version']}" if model["default_version"] else "")
    )
    if model["reason"]:
        console.print(f"  reason: {model['reason']}", highlight=False)
    for version, why in model.get("failures", {}).items():
        console.print(f"  [red]version {version} did not load:[/] {why}", highlight=False)
    for v in model["versions"]:
        console.print(
            f"\n version {v['version']}  {styled_state(v['state'])}  {v['platform']}  "
            f"{v['path']}\n sha256 {v['sha256']}",
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
    if model.get("events"):
        console.print("\n recent events")
        for event in model["events"]:
            stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
            version = f" v{event['version']}" if event["version"] else ""
            console.print(
                f"  {stamp} {event['kind']}{version}: {event['message']}", highlight=False
            )


def _repository_call(
    action: str, name: str, url: str | None, token: str | None, json: bool
) -> None:
    def call(c: Client) -> dict[str, Any]:
        if action == "unload":
            c.unload_model(name)
        else:
            c.load_model(name)
        return c.model(name)

    model = request(url, token, json, call)
    if json:
        print_json(model)
        return
    done = {"load": "loaded", "reload": "reloaded", "unload": "unloaded"}[action]
    default = model["default_version"]
    suffix = f", version {default} serving" if default and action != "unload" else ""
    console.print(f"{name}: {done}{suffix}")


NameArgument = Annotated[str, typer.Argument(help="Model name")]


@app.command("load")
def load(
    name: NameArgument, url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Load a model from the repository (reloads it when loaded); waits until it serves."""
    _repository_call("load", name, url, token, json)


@app.command("reload")
def reload(
    name: NameArgument, url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Load the model's files again in fresh workers, swap, drain the old ones."""
    _repository_call("reload", name, url, token, json)


@app.command("unload")
def unload(
    name: NameArgument, url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Drain a model and stop its workers; it stays unloaded until loaded again."""
    _repository_call("unload", name, url, token, json)


@app.command("keygen")
def keygen(
    key: Annotated[Path, typer.Argument(help="Where to write the private key (KEY.pub beside)")],
    json: JsonOption = False,
) -> None:
    """Make an ed25519 key pair for signing models."""
    from infergate.engine.verify import generate_key

    if key.exists():
        fail(
            f"{key} already exists; choose another path (keys are never overwritten)",
            EXIT_USAGE,
            json,
        )
    public = generate_key(key)
    if json:
        print_json({"private_key": str(key), "public_key": str(public)})
        return
    console.print(
        f"private key: {key} (keep it secret)\npublic key:  {public} "
        "(list it in the profile's server.trusted_keys)"
    )


@app.command("sign")
def sign(
    file: Annotated[Path, typer.Argument(help="Model file to sign")],
    key: Annotated[Path, typer.Option("--key", help="Private key from infergate model keygen")],
    json: JsonOption = False,
) -> None:
    """Write FILE.sig, a detached ed25519 signature of the file's SHA256."""
    from infergate.engine.verify import load_private_key, sha256_file, sign_file
    from infergate.errors import ConfigError

    if not file.is_file():
        fail(f"{file}: no such file", EXIT_USAGE, json)
    try:
        signature = sign_file(file, load_private_key(key))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, json)
    if json:
        print_json({"file": str(file), "signature": str(signature), "sha256": sha256_file(file)})
        return
    console.print(f"signed {file} -> {signature}")


@app.command("verify")
def verify(
    file: Annotated[Path, typer.Argument(help="Model file to check")],
    key: Annotated[
        list[Path] | None,
        typer.Option("--key", help="Trusted public key (repeatable); checks FILE.sig against them"),
    ] = None,
    sha256: Annotated[str | None, typer.Option(help="Expected SHA256")] = None,
    json: JsonOption = False,
) -> None:
    """Check a model file as the server would: SHA256, signature, and that it opens."""
    from infergate.engine.verify import (
        VerificationFailed,
        VerifyPolicy,
        load_public_key,
        signature_path,
        verify_file,
    )
    from infergate.errors import ConfigError

    if not file.is_file():
        fail(f"{file}: no such file", EXIT_USAGE, json)
    try:
        keys = tuple(load_public_key(k) for k in key or [])
        digest = verify_file(file, sha256, VerifyPolicy(bool(keys), keys))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, json)
    except VerificationFailed as exc:
        fail(str(exc), 1, json)
    report: dict[str, Any] = {
        "file": str(file),
        "sha256": digest,
        "signature": ("verified" if keys else "present, not checked (give --key)")
        if signature_path(file).exists()
        else "none",
    }
    report.update(_open(file))
    if json:
        print_json(report)
    else:
        for k, v in report.items():
            if k not in ("inputs", "outputs"):
                console.print(f"{k}: {v}", highlight=False)
        for kind in ("inputs", "outputs"):
            for t in report.get(kind, []):
                console.print(f"{kind[:-1]}: {t['name']} {t['datatype']} {t['shape']}")
    if "error" in report:
        raise typer.Exit(1)


def _open(file: Path) -> dict[str, Any]:
    """Open the file with its runtime, in this process, as a worker would."""
    from infergate.engine.runtimes import open_runtime, runtime_for, runtime_kind

    runtime = runtime_for(file)
    if runtime is None:
        return {"opens": "no", "error": f"{file.name}: no runtime opens {file.suffix!r} files"}
    if runtime_kind(runtime).needs_declared_tensors:
        return {"opens": f"not checked ({runtime} needs its tensors from model.toml)"}
    try:
        opened = open_runtime(runtime, file, "cpu")
    except Exception as exc:  # any failure to open is the answer here
        return {"opens": "no", "error": f"{type(exc).__name__}: {exc}"}
    return {
        "opens": "yes",
        "inputs": [s.to_json() for s in opened.inputs],
        "outputs": [s.to_json() for s in opened.outputs],
    }
