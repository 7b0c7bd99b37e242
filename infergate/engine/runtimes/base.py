"""The Runtime seam: open a model file on a device, describe it, run a batch.

Runtimes live only in worker processes; the gateway never imports onnxruntime or torch.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from infergate.engine.spec import TensorSpec
from infergate.tensors import Array, numpy_dtype


class Runtime(Protocol):
    @property
    def inputs(self) -> tuple[TensorSpec, ...]: ...

    @property
    def outputs(self) -> tuple[TensorSpec, ...]: ...

    @property
    def device(self) -> str:
        """Where it runs, for people: "cpu", "cuda:0"."""
        ...

    def run(self, inputs: dict[str, Array], output_names: list[str]) -> dict[str, Array]: ...


class RuntimeUnavailable(Exception):
    """The runtime's library is not installed; the message says how to install it."""


def sample_inputs(specs: tuple[TensorSpec, ...]) -> dict[str, Array]:
    """Inputs for a warm-up run: free dimensions become 1, values are zeros."""
    out: dict[str, Array] = {}
    for spec in specs:
        shape = tuple(1 if d < 0 else d for d in spec.shape)
        if spec.datatype == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr.fill(b"")
            out[spec.name] = arr
        else:
            out[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.datatype))
    return out
