"""`infergate model`: what the server holds and how each model is doing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from infergate.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    AdminTokenOption,
    Format,
    FormatOption,
    JsonOption,
    UrlOption,
    answer_of,
    check_model_name,
    chosen_format,
    emit_table,
    fail,
    make_app,
    print_json,
    request,
    say,
    styled_state,
)
from infergate.cli.helptext import example
from infergate.client_errors import escape_controls

if TYPE_CHECKING:
    from infergate.client import Client

app = make_app("List, inspect, load, unload, sign and verify models.")
TokenOption = AdminTokenOption  # every model command is an admin call


def _instances(version: dict[str, Any]) -> str:
    """Ready instances of all; for a remote model, endpoints that take requests of all."""
    remote = version.get("remote")
    if isinstance(remote, dict) and isinstance(remote.get("endpoints"), list):
        up = sum(1 for e in remote["endpoints"] if _takes_requests(e))
        return f"{up}/{len(remote['endpoints'])} upstream"
    ready = sum(1 for i in version["instances"] if i["state"] == "ready")
    return f"{ready}/{len(version['instances'])}"


def _takes_requests(endpoint: Any) -> bool:
    return (
        isinstance(endpoint, dict)
        and endpoint.get("healthy") is True
        and not endpoint.get("ejected")
    )


def model_rows(models: list[dict[str, Any]]) -> list[list[str | Text]]:
    """A row per served version, per version that failed to load (a new version that was
    refused leaves the old one serving: both show), and per model-wide problem (a refused
    model.toml edit) that no version row already says."""
    rows: list[list[str | Text]] = []
    for model in models:
        shown: set[str] = set()  # reasons a row says already
        said: dict[str, str] = {}  # version -> the reason its row says
        for v in model["versions"]:
            marker = "*" if v["version"] == model["default_version"] else ""
            rows.append(
                [
                    model["name"],
                    f"{v['version']}{marker}",
                    styled_state(v["state"]),
                    _instances(v),
                    v["platform"],
                    v["reason"] or "",
                ]
            )
            shown.add(v["reason"] or "")
            said[str(v["version"])] = v["reason"] or ""
        failures = model.get("failures") or {}
        for version, why in failures.items():
            # a version that failed, or a new file for a served one (the old one serves on)
            if said.get(version) != why:
                rows.append([model["name"], version, styled_state("failed"), "-", "-", why])
        reason = model["reason"] or ""
        # The registry's model-wide reason for a failure ("version N: why", and what keeps
        # serving) repeats that version's row.
        repeats = any(reason.startswith(f"version {v}: {why}") for v, why in failures.items())
        if not model["versions"] and not failures or reason and not repeats and reason not in shown:
            # With versions serving, it is a change that was refused (a model.toml edit):
            # its row says so, not the state of what keeps serving.
            state = "refused" if model["versions"] else model["state"]
            rows.append([model["name"], "-", styled_state(state), "-", "-", reason])
    return rows


@app.command(
    "list", epilog=example("infergate model list", "infergate model list --format tsv | cut -f1,3")
)
def list_models(
    url: UrlOption = None,
    token: TokenOption = None,
    fmt: FormatOption = Format.table,
    json: JsonOption = False,
) -> None:
    """List every model in the repository with its versions and state, failed loads
    included."""
    fmt = chosen_format(fmt, json)
    models = request(url, token, fmt is Format.json, lambda c: c.models())
    if fmt is Format.json:
        print_json(models)
        return
    with answer_of(url, False):
        rows = model_rows(models)
    emit_table(["model", "version", "state", "instances", "platform", "reason"], rows, fmt)


@app.command("status", epilog=example("infergate model status digits"))
def status(
    name: Annotated[str, typer.Argument(help="Model name")],
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """One model in detail: versions, instances with their PIDs and devices, tensors."""
    check_model_name(name, json)
    model = request(url, token, json, lambda c: c.model(name))
    if json:
        print_json(model)
        return
    with answer_of(url, False):
        _show_status(model)


def _show_status(model: dict[str, Any]) -> None:
    """The model as the server describes it: each of its values escaped (`escape_controls`)
    before it goes into a line of the CLI's own."""
    e = _escaped
    head = Text.assemble((e(model["name"]), "bold"), "  ", styled_state(e(model["state"])))
    if model["default_version"]:
        head.append(f"  default version {e(model['default_version'])}")
    say(head)
    if model["reason"]:
        say(f"  reason: {e(model['reason'])}")
    for version, why in (model.get("failures") or {}).items():
        say(Text.assemble("  ", (f"version {e(version)} did not load:", "red"), f" {e(why)}"))
    for v in model["versions"]:
        say(
            Text.assemble(
                f"\n version {e(v['version'])}  ",
                styled_state(e(v["state"])),
                f"  {e(v['platform'])}  {e(v['path'])}\n sha256 {e(v['sha256'])}",
            )
        )
        remote = v.get("remote")
        if isinstance(remote, dict) and isinstance(remote.get("endpoints"), list):
            say(f" upstream model {e(str(remote.get('model')))}")
            emit_table(
                ["endpoint", "healthy", "ejected", "in flight", "sent"],
                [
                    [str(x.get(k)) for k in ("endpoint", "healthy", "ejected", "in_flight", "sent")]
                    for x in remote["endpoints"]
                    if isinstance(x, dict)
                ],
                Format.table,
            )
        else:
            emit_table(
                ["instance", "state", "pid", "device", "restarts", "reason"],
                [
                    [
                        str(i["index"]),
                        styled_state(i["state"]),
                        str(i["pid"] or "-"),
                        i["device"] or "-",
                        str(i["restarts"]),
                        i["reason"] or "",
                    ]
                    for i in v["instances"]
                ],
                Format.table,
            )
        emit_table(
            ["tensor", "name", "datatype", "shape"],
            [
                [kind[:-1], t["name"], t["datatype"], str(t["shape"])]
                for kind in ("inputs", "outputs")
                for t in v[kind]
            ],
            Format.table,
        )
    if model.get("events"):
        say("\n recent events")
        for event in model["events"]:
            stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
            version = f" v{e(event['version'])}" if event["version"] else ""
            say(f"  {stamp} {e(event['kind'])}{version}: {e(event['message'])}")


def _escaped(value: Any) -> str:
    """A value from the server's answer as inert text for a line of the CLI's own."""
    return escape_controls(str(value))


def _repository_call(
    action: str, name: str, url: str | None, token: str | None, json: bool
) -> None:
    check_model_name(name, json)

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
    default = model.get("default_version")
    serving = f", version {escape_controls(str(default))} serving"
    suffix = serving if default and action != "unload" else ""
    say(f"{name}: {done}{suffix}")


NameArgument = Annotated[str, typer.Argument(help="Model name")]


@app.command("load", epilog=example("infergate model load digits"))
def load(
    name: NameArgument, url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Load a model from the repository (reloads it when loaded); waits until it serves."""
    _repository_call("load", name, url, token, json)


@app.command("reload", epilog=example("infergate model reload digits"))
def reload(
    name: NameArgument, url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Load the model's files again in fresh workers, swap, drain the old ones."""
    _repository_call("reload", name, url, token, json)


@app.command("unload", epilog=example("infergate model unload digits"))
def unload(
    name: NameArgument, url: UrlOption = None, token: TokenOption = None, json: JsonOption = False
) -> None:
    """Drain a model and stop its workers; it stays unloaded until loaded again."""
    _repository_call("unload", name, url, token, json)


@app.command("keygen", epilog=example("infergate model keygen signing.key"))
def keygen(
    key: Annotated[Path, typer.Argument(help="Where to write the private key (KEY.pub beside)")],
    json: JsonOption = False,
) -> None:
    """Make an ed25519 key pair for signing models."""
    from infergate.engine.repository.verify import generate_key

    if key.exists() or key.is_symlink():
        fail(
            f"{key} already exists; choose another path (keys are never overwritten)",
            EXIT_USAGE,
            json,
        )
    public = key.with_name(key.name + ".pub")
    if public.exists() or public.is_symlink():
        fail(f"{public} already exists; choose another path for the key", EXIT_USAGE, json)
    try:
        public = generate_key(key)
    except OSError as exc:
        fail(f"cannot write the key to {key}: {exc.strerror or exc}", EXIT_USAGE, json)
    if json:
        print_json({"private_key": str(key), "public_key": str(public)})
        return
    say(
        f"private key: {key} (keep it secret)\npublic key:  {public} "
        "(list it in the profile's server.trusted_keys)"
    )


@app.command(
    "sign", epilog=example("infergate model sign models/digits/1/model.onnx --key signing.key")
)
def sign(
    file: Annotated[
        Path, typer.Argument(help="Model file to sign (a remote model's: its model.toml)")
    ],
    key: Annotated[Path, typer.Option("--key", help="Private key from infergate model keygen")],
    json: JsonOption = False,
) -> None:
    """Write FILE.sig, a detached ed25519 signature of the file's SHA256."""
    from infergate.engine.repository.verify import (
        VerificationFailed,
        load_private_key,
        sha256_file,
        sign_file,
    )
    from infergate.errors import ConfigError

    _model_file(file, json)
    try:
        signature = sign_file(file, load_private_key(key))
        digest = sha256_file(file)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, json)
    except VerificationFailed as exc:
        fail(str(exc), EXIT_USAGE, json)
    except OSError as exc:
        fail(f"cannot sign {file}: {exc.strerror or exc}", EXIT_FAILURE, json)
    if json:
        print_json({"file": str(file), "signature": str(signature), "sha256": digest})
        return
    say(f"signed {file} -> {signature}")


@app.command(
    "verify",
    epilog=example("infergate model verify models/digits/1/model.onnx --key signing.key.pub"),
)
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
    from infergate.engine.repository.verify import (
        VerificationFailed,
        VerifyPolicy,
        load_public_key,
        signature_path,
        verify_file,
    )
    from infergate.errors import ConfigError

    _model_file(file, json)
    try:
        keys = tuple(load_public_key(k) for k in key or [])
        if keys and not signature_path(file).exists():
            fail(
                f"{file} is not signed: {signature_path(file)} does not exist. "
                f"Hint: infergate model sign {file} --key KEY",
                EXIT_FAILURE,
                json,
            )
        digest = verify_file(file, None, VerifyPolicy(bool(keys), keys))
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, json)
    except VerificationFailed as exc:
        fail(str(exc), EXIT_FAILURE, json)
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}", EXIT_FAILURE, json)
    if sha256 is not None and sha256.strip().lower() != digest:
        fail(f"{file} has SHA256 {digest}, not the {sha256!r} of --sha256", EXIT_FAILURE, json)
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
            if k not in ("inputs", "outputs", "error"):
                say(f"{k}: {v}")
        for kind in ("inputs", "outputs"):
            for t in report.get(kind, []):
                say(f"{kind[:-1]}: {t['name']} {t['datatype']} {t['shape']}")
    if "error" in report:
        if not json:
            fail(f"{file} is not a model infergate can serve: {report['error']}")
        raise typer.Exit(1)


def _model_file(file: Path, as_json: bool) -> None:
    if not file.exists():
        fail(f"{file}: no such file", EXIT_USAGE, as_json)
    if not file.is_file():
        fail(f"{file}: not a regular file (a directory, a FIFO?)", EXIT_USAGE, as_json)


def _is_remote_model(file: Path) -> bool:
    """Whether `file` is a remote model's model.toml (signed and verified as a model file
    is, but served by its upstreams)."""
    import tomllib

    if file.name != "model.toml":
        return False
    try:
        with file.open("rb") as f:
            return tomllib.load(f).get("runtime") == "remote"
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False


def _open(file: Path) -> dict[str, Any]:
    """Open the file with its runtime, in this process, as a worker would."""
    from infergate.engine.runtimes import open_runtime, runtime_for, runtime_kind

    runtime = runtime_for(file)
    if runtime is None and _is_remote_model(file):
        return {"opens": "not checked (a remote model: its upstreams serve it)"}
    if runtime is None:
        return {
            "opens": "no",
            "error": f"no runtime opens {file.suffix or 'extension-less'!r} files "
            "(.onnx, .pt, or a plugin's)",
        }
    if runtime_kind(runtime).needs_declared_tensors:
        return {"opens": f"not checked ({runtime} needs its tensors from model.toml)"}
    try:
        opened = open_runtime(runtime, file, "cpu")
    except Exception as exc:  # any failure to open is the answer here
        message = " ".join(str(exc).split())  # one line
        return {
            "opens": "no",
            "error": f"{runtime} cannot open it: {type(exc).__name__}: {message}",
        }
    return {
        "opens": "yes",
        "inputs": [s.to_json() for s in opened.inputs],
        "outputs": [s.to_json() for s in opened.outputs],
    }
