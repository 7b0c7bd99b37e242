"""Runtimes, imported lazily: each worker pays only for the library it uses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from infergate.engine.runtimes.base import Runtime, RuntimeUnavailable
from infergate.engine.spec import RuntimeName, TensorSpec

INSTALL_HINTS: dict[RuntimeName, tuple[str, str]] = {
    "onnx": ("onnxruntime", "pip install onnxruntime   (or ./install.sh)"),
    "torchscript": ("torch", "pip install 'infergate[torch]'   (or ./install.sh --torch)"),
}


def unavailable_reason(runtime: RuntimeName) -> str | None:
    """Why `runtime` cannot run here, with the install command; None when it can.

    Only looks for the package, so the gateway can ask without importing torch.
    """
    module, hint = INSTALL_HINTS[runtime]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses the name: as good as absent
        found = False
    if not found:
        return f"the {runtime} runtime needs {module}, which is not installed. Hint: {hint}"
    return None


def open_runtime(
    runtime: RuntimeName,
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
    if runtime == "onnx":
        from infergate.engine.runtimes.onnx import OnnxRuntime

        return OnnxRuntime(path, device, threads, memory_mb)
    from infergate.engine.runtimes.torchscript import TorchScriptRuntime

    return TorchScriptRuntime(path, device, inputs, outputs, threads, memory_mb)
