"""TorchScript: names, datatypes and shapes come from model.toml (the file has none)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from infergate.engine.repository.spec import TensorSpec
from infergate.tensors import Array, numpy_dtype


def open_torchscript(
    path: Path,
    device: str,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    threads: int | None,
    memory_mb: int | None,
) -> TorchScriptRuntime:
    return TorchScriptRuntime(path, device, inputs, outputs, threads, memory_mb)


class TorchScriptRuntime:
    def __init__(
        self,
        path: Path,
        device: str,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        threads: int | None = None,
        memory_mb: int | None = None,
    ) -> None:
        if not inputs or not outputs:
            raise ValueError(
                f"{path}: a TorchScript model needs its [[inputs]] and [[outputs]] declared in "
                "model.toml (name, datatype, shape). Hint: see models/encoder/model.toml"
            )
        if threads:
            torch.set_num_threads(threads)
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"device {device} asked for, but torch sees no CUDA device")
        self._device = device
        if device.startswith("cuda") and memory_mb:
            index = torch.device(device).index or 0
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory_mb * 2**20 / total), index)
        with warnings.catch_warnings():
            # torch 2.13 deprecates TorchScript for torch.export; TorchScript is what we serve.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
        self._module.eval()
        self._inputs = inputs
        self._outputs = outputs

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
        args = [
            torch.from_numpy(np.ascontiguousarray(inputs[s.name])).to(self._device)
            for s in self._inputs
        ]
        with torch.inference_mode():
            result = self._module(*args)
        tensors = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(tensors) != len(self._outputs):
            raise RuntimeError(
                f"the module returned {len(tensors)} outputs but model.toml declares "
                f"{len(self._outputs)}"
            )
        by_name = {}
        for spec, tensor in zip(self._outputs, tensors, strict=True):
            if spec.name in output_names:
                array = tensor.detach().cpu().numpy()
                by_name[spec.name] = array.astype(numpy_dtype(spec.datatype), copy=False)
        return by_name
