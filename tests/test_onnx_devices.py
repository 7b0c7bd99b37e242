"""Where an ONNX session really runs: onnxruntime drops a GPU provider that fails to start
and carries on, on the CPU. The device reported (model status, stats) must say so, and a
model placed on a GPU by name must not run on the CPU unseen. A CPU-only onnxruntime cannot
start a CUDA session here, so the decision is tested on the providers a session reports."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from infergate.engine.runtimes.onnx import OnnxRuntime, device_in_use
from tests.onnx_models import make_mlp


def test_a_session_that_kept_its_gpu_provider_runs_on_the_gpu() -> None:
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert device_in_use("cuda:1", "cuda:1", providers) == "cuda:1"
    assert device_in_use("auto", "cuda:0", ["TensorrtExecutionProvider", *providers]) == "cuda:0"


def test_auto_that_fell_back_to_the_cpu_says_cpu() -> None:
    assert device_in_use("auto", "cuda:0", ["CPUExecutionProvider"]) == "cpu"


def test_a_gpu_named_that_fell_back_to_the_cpu_is_refused_with_a_hint() -> None:
    with pytest.raises(RuntimeError) as caught:
        device_in_use("cuda:0", "cuda:0", ["CPUExecutionProvider"])
    message = str(caught.value)
    assert "CUDA provider did not start" in message
    assert "providers in use: CPUExecutionProvider" in message
    assert 'device = "cpu" in model.toml' in message


def test_the_cpu_is_the_cpu() -> None:
    assert device_in_use("cpu", "cpu", ["CPUExecutionProvider"]) == "cpu"
    assert device_in_use("auto", "cpu", ["CPUExecutionProvider"]) == "cpu"


def test_auto_runs_where_onnxruntime_can_and_a_gpu_by_name_needs_one(tmp_path: Path) -> None:
    path = make_mlp(tmp_path / "m.onnx", (4, 8, 2))
    if "CUDAExecutionProvider" in ort.get_available_providers():  # scripts/gpu_check.sh
        assert OnnxRuntime(path, "auto").device == "cuda:0"
        assert OnnxRuntime(path, "cuda:0").device == "cuda:0"
        return
    assert OnnxRuntime(path, "auto").device == "cpu"
    with pytest.raises(RuntimeError, match="onnxruntime has no CUDA provider"):
        OnnxRuntime(path, "cuda:0")
