"""`infergate doctor`: what this machine can serve, and what stands in the way."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from infergate.cli.common import (
    EXIT_USAGE,
    Format,
    FormatOption,
    JsonOption,
    check_models_folder,
    chosen_format,
    emit_table,
    fail,
    print_json,
)

if TYPE_CHECKING:
    from infergate.engine.repository.spec import ModelEntry
    from infergate.engine.repository.verify import VerifyPolicy
    from infergate.profile import Profile


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, warn, fail
    detail: str


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _python() -> Check:
    ok = sys.version_info >= (3, 10)
    return Check(
        "python",
        "ok" if ok else "fail",
        f"{platform.python_version()} on {platform.system()} {platform.machine()}",
    )


def _onnxruntime() -> Check:
    try:
        import onnxruntime as ort
    except ImportError:
        return Check("onnxruntime", "fail", "not installed. Hint: ./install.sh")
    providers = ", ".join(ort.get_available_providers())
    return Check("onnxruntime", "ok", f"{ort.__version__}; providers: {providers}")


def _torch() -> Check:
    version = _version("torch")
    if version is None:
        from infergate.engine.runtimes import TORCH_INSTALL

        return Check(
            "torch",
            "warn",
            f"not installed: TorchScript models are unavailable. Hint: {TORCH_INSTALL}, then "
            "infergate model load NAME",
        )
    if _torch_is_cpu_build():
        # Not imported, so a build that cannot load (a missing libgomp, a numpy ABI
        # mismatch) shows only when a TorchScript model loads: say how to check it.
        return Check(
            "torch",
            "ok",
            f"{version}; CPU only (a CPU build, read from torch/version.py without importing "
            "it; `python -c 'import torch'` checks that it loads)",
        )
    import torch

    cuda = (
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
        if torch.cuda.is_available()
        else "CPU only"
    )
    return Check("torch", "ok", f"{version}; {cuda}")


def _torch_is_cpu_build() -> bool:
    """Whether the installed torch was built without CUDA and ROCm, read from its
    `torch/version.py` (`cuda = None`, `hip = None`) instead of importing torch: the import
    costs about 2 s of CPU, and a CPU build cannot see a GPU anyway. False when in doubt,
    and then the caller asks torch itself."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        source = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return False
    assigned: dict[str, object] = {}
    for node in tree.body:
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            assigned[target.id] = value.value
    return "cuda" in assigned and assigned["cuda"] is None and assigned.get("hip") is None


def _nvml() -> Check:
    try:
        import pynvml
    except ImportError:
        return Check(
            "nvml",
            "ok",
            "nvidia-ml-py not installed: serving on the CPU "
            "(./install.sh adds it when nvidia-smi answers)",
        )
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)
        ]
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        return Check("nvml", "warn", f"installed but no GPU answers: {exc}")
    return Check("nvml", "ok", f"{count} GPU(s): {', '.join(map(str, names))}")


def _devices() -> list[Check]:
    from infergate.engine.placement.devices import choose_backend

    backend = choose_backend("auto", [])
    checks = [
        Check(
            "device backend",
            "ok",
            f"{backend.name} (chosen automatically: NVML when a GPU answers, else the host)",
        )
    ]
    for d in backend.devices():
        extra = f", {d.temperature_c:.0f} C" if d.temperature_c is not None else ""
        checks.append(
            Check(
                f"device {d.name}",
                "ok",
                f"{d.kind}, {d.memory_used_mb / 1024:.1f} of "
                f"{d.memory_total_mb / 1024:.1f} GiB used, {d.utilization:.0f}% "
                f"busy{extra}",
            )
        )
    return checks


def _models(models: Path, profile: Profile) -> list[Check]:
    from infergate.engine.repository.scan import scan_repository
    from infergate.engine.repository.verify import VerifyPolicy, load_public_key
    from infergate.engine.runtimes import unavailable_reason
    from infergate.errors import ConfigError

    try:
        entries = scan_repository(models)
    except ConfigError as exc:
        return [Check("models", "fail", str(exc))]
    checks = [Check("models", "ok" if entries else "warn", f"{len(entries)} model(s) in {models}")]
    server = profile.server
    try:
        keys = tuple(load_public_key(k) for k in server.trusted_keys)
    except ConfigError as exc:
        return [*checks, Check("trusted keys", "fail", str(exc))]
    policy = VerifyPolicy(server.require_signed_models, keys)
    for entry in entries:
        problem = entry.problem or _refused(entry, policy)
        if problem:
            checks.append(Check(f"model {entry.name}", "fail", problem))
            continue
        runtimes = {v.runtime for v in entry.versions}
        reasons = [r for r in map(unavailable_reason, sorted(runtimes)) if r]
        versions = ", ".join(str(v.version) for v in entry.served_versions())
        checks.append(
            Check(
                f"model {entry.name}",
                "warn" if reasons else "ok",
                "; ".join(reasons) or f"{'/'.join(sorted(runtimes))}, version(s) {versions}",
            )
        )
    return checks


def _refused(entry: ModelEntry, policy: VerifyPolicy) -> str | None:
    """Why the server would refuse a version it would serve, by the profile's signature
    rule or model.toml's pinned sha256 (each such file is read and hashed); else None."""
    from infergate.engine.repository.verify import VerificationFailed, verify_file

    pin = entry.config.sha256
    if not (policy.require_signed or pin):
        return None
    for version in entry.served_versions():
        if version.runtime == "remote":
            continue  # (no model file)
        try:
            verify_file(version.path, pin, policy)
        except VerificationFailed as exc:
            return f"version {version.version}: {exc}"
        except OSError as exc:  # (no permission, a .sig that cannot be read: as serve says)
            return f"version {version.version}: {version.path} cannot be read: {exc}"
    return None


def _watching(models: Path) -> Check:
    """Can the gateway watch the folder for changes (inotify watches, open files)?"""
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer

    if not models.is_dir():
        return Check("watching", "fail", f"{models} does not exist, so it cannot be watched")
    observer = Observer()
    try:
        observer.schedule(FileSystemEventHandler(), str(models), recursive=True)
        observer.start()
    except Exception as exc:
        return Check(
            "watching",
            "fail",
            f"cannot watch {models} for changes ({type(exc).__name__}: {exc}): models would "
            "not reload when their files change. Hint: raise fs.inotify.max_user_watches and "
            "max_user_instances (sysctl) or the open file limit (ulimit -n)",
        )
    finally:
        observer.stop()
        if observer.is_alive():
            observer.join(5)
    return Check("watching", "ok", f"{models} can be watched for changes")


STYLES = {"ok": "green", "warn": "yellow", "fail": "red"}


def doctor(
    models: Annotated[
        Path | None,
        typer.Option(
            help="Model repository to check [default: the profile's server.models, else models/]"
        ),
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(
            envvar="INFERGATE_PROFILE",
            help="Profile whose rules apply (signed models) [default: profiles/default.toml "
            "when present]",
        ),
    ] = None,
    fmt: FormatOption = Format.table,
    json: JsonOption = False,
) -> None:
    """Check Python, runtimes, GPUs and the models folder; exit 1 if something fails."""
    from infergate.errors import ConfigError
    from infergate.profile import load_profile

    fmt = chosen_format(fmt, json)
    try:
        loaded = load_profile(profile)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, fmt is Format.json)
    models = models or loaded.server.models
    check_models_folder(models, as_json=fmt is Format.json)
    checks = [
        _python(),
        _onnxruntime(),
        _torch(),
        _nvml(),
        *_devices(),
        *_models(models, loaded),
        _watching(models),
    ]
    if fmt is Format.json:
        print_json([asdict(c) for c in checks])
    else:
        emit_table(
            ["check", "status", "detail"],
            [[c.name, Text(c.status, style=STYLES[c.status]), c.detail] for c in checks],
            fmt,
        )
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)
