"""The runtime registry: which runtimes exist, the model files each opens, and how to open
one. Runtimes are imported lazily: each worker pays only for the library it uses.

Built in: `onnx` (onnxruntime), `torchscript` (torch) and `remote` (other V2 servers,
reached from the gateway process: infergate.engine.remote; it opens no file). More can be
registered by modules named in the INFERGATE_RUNTIME_PLUGINS environment variable
(comma-separated), imported in the gateway and in every worker on first use: the test
suite registers its scripted runtime this way, and nothing else ever sees it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infergate.engine.repository.spec import TensorSpec
from infergate.engine.runtimes.base import Runtime, RuntimeUnavailable

PLUGINS_ENV = "INFERGATE_RUNTIME_PLUGINS"
# PyPI's torch carries CUDA (several GB); PyTorch's own index has the CPU build.
TORCH_INSTALL = (
    "./install.sh --torch (on a machine without a GPU: "
    "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu ./install.sh --torch, for "
    "torch's CPU build instead of PyPI's CUDA one of several GB)"
)
log = logging.getLogger("infergate.runtimes")

# (path, device, inputs declared in model.toml, outputs declared, threads, memory_mb)
Opener = Callable[
    [Path, str, tuple[TensorSpec, ...], tuple[TensorSpec, ...], "int | None", "int | None"],
    Runtime,
]


@dataclass(frozen=True)
class RuntimeKind:
    """One runtime: its name in model.toml, the files it opens and how to open them."""

    name: str
    suffixes: tuple[str, ...]  # model file extensions it claims, with the dot
    platform: str  # as Triton's metadata names it
    package: str  # the module it needs installed
    install_hint: str
    opener: str  # "module:function" with the Opener signature, imported in the worker
    needs_declared_tensors: bool = False  # the file has no tensor names (TorchScript)
    in_gateway: bool = False  # served by the gateway itself, without workers (remote)


BUILT_IN = (
    RuntimeKind(
        "onnx",
        (".onnx",),
        "onnxruntime_onnx",
        "onnxruntime",
        "./install.sh (or .venv/bin/pip install onnxruntime), then infergate model load NAME",
        "infergate.engine.runtimes.onnx:open_onnx",
    ),
    RuntimeKind(
        "torchscript",
        (".pt", ".pth", ".torchscript"),
        "pytorch_libtorch",
        "torch",
        TORCH_INSTALL + ", then infergate model load NAME",
        "infergate.engine.runtimes.torchscript:open_torchscript",
        needs_declared_tensors=True,
    ),
    RuntimeKind(
        "remote",
        (),
        "remote",
        "httpx",
        "./install.sh (or .venv/bin/pip install httpx), then infergate model load NAME",
        "",  # never opened in a worker: infergate.engine.remote.served
        in_gateway=True,
    ),
)

_kinds: dict[str, RuntimeKind] = {k.name: k for k in BUILT_IN}
_plugins_loaded = False
_plugins_lock = threading.RLock()  # scans run in threads: one imports, the others wait


def register(kind: RuntimeKind) -> None:
    """Add a runtime (from a plugin module). Its suffixes must not be claimed already."""
    for other in _kinds.values():
        if other.name != kind.name and set(other.suffixes) & set(kind.suffixes):
            raise ValueError(f"runtime {kind.name}: suffixes already claimed by {other.name}")
    _kinds[kind.name] = kind


def _all() -> dict[str, RuntimeKind]:
    global _plugins_loaded
    if not _plugins_loaded:
        with _plugins_lock:
            if not _plugins_loaded:
                for module in filter(None, os.environ.get(PLUGINS_ENV, "").split(",")):
                    try:
                        importlib.import_module(module.strip())  # it calls register()
                    except ImportError as exc:  # the built-in runtimes still serve
                        log.error(
                            "runtime plugin %r (named in %s) cannot be imported: %s. Hint: "
                            "put it on PYTHONPATH, or remove it from %s",
                            module.strip(),
                            PLUGINS_ENV,
                            exc,
                            PLUGINS_ENV,
                        )
                _plugins_loaded = True
    return _kinds


def runtime_names() -> tuple[str, ...]:
    return tuple(_all())


def runtime_kind(name: str) -> RuntimeKind:
    return _all()[name]


def model_suffixes() -> tuple[str, ...]:
    """Every file extension some runtime opens, in registration order."""
    return tuple(s for k in _all().values() for s in k.suffixes)


def runtime_for(path: Path) -> str | None:
    """The runtime that opens files like `path`, by extension; None: no runtime does."""
    for kind in _all().values():
        if path.suffix in kind.suffixes:
            return kind.name
    return None


def unavailable_reason(runtime: str, model: str = "NAME") -> str | None:
    """Why `runtime` cannot run here, with the install command and the load that follows
    it (of `model`, when one is asking); None when it can.

    Only looks for the package, so the gateway can ask without importing torch.
    """
    kind = runtime_kind(runtime)
    try:
        found = importlib.util.find_spec(kind.package) is not None
    except ImportError:  # a finder that refuses the name: as good as absent
        found = False
    if not found:
        return (
            f"the {runtime} runtime needs {kind.package}, which is not installed. "
            f"Hint: {kind.install_hint.replace(' NAME', f' {model}')}"
        )
    return None


def open_runtime(
    runtime: str,
    path: Path,
    device: str,
    inputs: tuple[TensorSpec, ...] = (),
    outputs: tuple[TensorSpec, ...] = (),
    threads: int | None = None,
    memory_mb: int | None = None,
) -> Runtime:
    reason = unavailable_reason(runtime)
    if reason:
        raise RuntimeUnavailable(reason)
    module, _, function = runtime_kind(runtime).opener.partition(":")
    opener: Opener = getattr(importlib.import_module(module), function)
    return opener(path, device, inputs, outputs, threads, memory_mb)
