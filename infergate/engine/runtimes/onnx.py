"""onnxruntime: providers chosen from what is present, tensors read from the graph."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from infergate.engine.repository.spec import TensorSpec
from infergate.errors import DataNotServable
from infergate.tensors import Array

_ONNX_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def _spec(arg: Any) -> TensorSpec:
    datatype = _ONNX_TYPES.get(arg.type)
    if datatype is None:
        raise ValueError(f"{arg.name}: ONNX type {arg.type} is not served (no V2 datatype)")
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in arg.shape)
    return TensorSpec(name=arg.name, datatype=datatype, shape=shape)


def choose_providers(device: str, memory_mb: int | None = None) -> tuple[list[Any], str]:
    """Providers for `device` ("auto", "cpu", "cuda", "cuda:N") and the device asked of them."""
    available = ort.get_available_providers()
    if device != "cpu" and "CUDAExecutionProvider" in available:
        _preload_cuda_libraries()
        index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        options: dict[str, Any] = {"device_id": index}
        if memory_mb:
            options["gpu_mem_limit"] = memory_mb * 2**20  # the CUDA arena stops here
        providers: list[Any] = []
        if "TensorrtExecutionProvider" in available and device != "cuda-no-trt":
            providers.append(("TensorrtExecutionProvider", options))
        providers += [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
        return providers, f"cuda:{index}"
    if device.startswith("cuda"):
        raise RuntimeError(
            f"device {device} asked for, but onnxruntime has no CUDA provider "
            f"(available: {', '.join(available)}). Hint: install the gpu extra: "
            "./install.sh on a host where nvidia-smi answers (or .venv/bin/pip install "
            "'infergate[gpu]')"
        )
    return ["CPUExecutionProvider"], "cpu"


_preloaded = False


def _preload_cuda_libraries() -> None:
    """Load CUDA and cuDNN before the CUDA provider needs them: a pip-installed CUDA (torch's,
    or the nvidia-* wheels) is on no library path, and without this onnxruntime falls back to
    the CPU with no more than an error line (onnxruntime-gpu >= 1.21 has preload_dlls)."""
    global _preloaded
    preload = getattr(ort, "preload_dlls", None)
    if preload is None or _preloaded:
        return
    _preloaded = True
    # A library missing here shows up after, as the CUDA provider not in use.
    with contextlib.suppress(Exception):
        preload()


def device_in_use(asked_device: str, planned: str, providers_in_use: list[str]) -> str:
    """Where the session really runs. onnxruntime drops a GPU provider that fails to start
    (a CUDA or cuDNN library missing, a driver too old) and carries on, on the CPU: "auto"
    may do that too, but a model placed on a GPU (the gateway asks for "cuda:0" then) must not
    run on the CPU unseen, holding a GPU's reservation."""
    if not planned.startswith("cuda") or {
        "CUDAExecutionProvider",
        "TensorrtExecutionProvider",
    } & set(providers_in_use):
        return planned
    if asked_device == "auto":
        return "cpu"
    raise RuntimeError(
        f"device {asked_device} asked for, but onnxruntime's CUDA provider did not start "
        f"(providers in use: {', '.join(providers_in_use)}); the worker's log says why, "
        "often a CUDA or cuDNN library that is not found. Hint: install the CUDA 12/13 "
        "libraries onnxruntime-gpu was built for (the nvidia-* wheels, or torch with CUDA), or "
        'set device = "cpu" in model.toml'
    )


def open_onnx(
    path: Path,
    device: str,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    threads: int | None,
    memory_mb: int | None,
) -> OnnxRuntime:
    """The registry's opener: the graph names its own tensors (model.toml's are checked
    against them by the worker)."""
    return OnnxRuntime(path, device, threads, memory_mb)


class OnnxRuntime:
    def __init__(
        self, path: Path, device: str, threads: int | None = None, memory_mb: int | None = None
    ) -> None:
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Workers share the cores with the gateway and each other: threads that spin while
        # waiting for work steal the CPU the gateway needs to feed them (about 10% of
        # throughput on two cores).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers, asked = choose_providers(device, memory_mb)
        self._session = ort.InferenceSession(str(path), options, providers=providers)
        self._device = device_in_use(device, asked, self._session.get_providers())
        self._inputs = tuple(_spec(a) for a in self._session.get_inputs())
        self._outputs = tuple(_spec(a) for a in self._session.get_outputs())
        self._strings = {s.name for s in self._inputs if s.datatype == "BYTES"}

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    @property
    def device(self) -> str:
        return self._device

    def run(self, inputs: dict[str, Array], output_names: list[str]) -> dict[str, Array]:
        feed: dict[str, Any] = {}
        for name, value in inputs.items():
            feed[name] = _string_feed(value) if name in self._strings else value
        try:
            results = self._session.run(output_names, feed)
        except UnicodeDecodeError as exc:
            # onnxruntime's Python API hands string outputs back as str only.
            raise DataNotServable(
                f"the model produced a string output that is not UTF-8 text ({exc.reason} at "
                f"byte {exc.start}); onnxruntime cannot return it as bytes. Hint: send text "
                "(UTF-8) in its BYTES inputs"
            ) from None
        return {name: np.asarray(r) for name, r in zip(output_names, results, strict=True)}


def _string_feed(value: Array) -> Array:
    """V2 BYTES → an onnxruntime string tensor, without changing a byte.

    onnxruntime takes str (it stores the UTF-8) or fixed-width bytes ("S", stored as is).
    Text goes as str; bytes that are not UTF-8 go as "S", which keeps every byte except
    trailing NULs (numpy's fixed-width strings drop those). Decoding with "replace", as
    before, silently handed the model different bytes."""
    flat = value.reshape(-1)
    try:
        text = [b.decode("utf-8") if isinstance(b, bytes) else str(b) for b in flat]
    except UnicodeDecodeError:
        raw = [b if isinstance(b, bytes) else str(b).encode("utf-8") for b in flat]
        return np.array(raw, dtype=np.bytes_).reshape(value.shape)
    out = np.empty(len(text), dtype=object)
    out[:] = text
    return out.reshape(value.shape)
