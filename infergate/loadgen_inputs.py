"""The requests a load sends: inputs that fit a model's metadata (perf_analyzer's random
data and --shape), encoded once as a V2 request body (binary or JSON tensors)."""

from __future__ import annotations

from typing import Any

import numpy as np

from infergate.client_codec import encode_infer_request
from infergate.tensors import Array, numpy_dtype


def sample_inputs(
    metadata: dict[str, Any],
    batch: int,
    seed: int = 0,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, Array]:
    """Inputs that fit a model's metadata: a leading free dimension is `batch`; the rest of
    the shape comes from `shapes` (perf_analyzer's --shape, without the batch dimension)
    or, for free dimensions, 1; values random in the datatype's range."""
    rng = np.random.default_rng(seed)
    out: dict[str, Array] = {}
    for spec in metadata.get("inputs", []):
        shape = input_shape(spec["name"], spec["shape"], batch, (shapes or {}).get(spec["name"]))
        datatype = spec["datatype"]
        if datatype == "BYTES":
            array = np.empty(shape, dtype=object)
            array.fill(b"infergate")
        elif datatype == "BOOL":
            array = rng.integers(0, 2, shape).astype(bool)
        else:
            dtype = numpy_dtype(datatype)
            if dtype.kind == "f":
                array = rng.standard_normal(shape).astype(dtype)
            else:
                array = rng.integers(0, 10, shape).astype(dtype)
        out[spec["name"]] = array
    return out


def input_shape(
    name: str, dims: list[int], batch: int, given: tuple[int, ...] | None
) -> tuple[int, ...]:
    batched = bool(dims) and dims[0] < 0
    rest = dims[1:] if batched else dims
    if given is None:
        shape = tuple(1 if d < 0 else d for d in rest)
    else:
        fits = len(given) == len(rest) and all(
            d < 0 or d == g for d, g in zip(rest, given, strict=True)
        )
        if not fits or any(g < 1 for g in given):
            raise ValueError(
                f"--shape {name}:{','.join(map(str, given))} does not fit the model's "
                f"{dims}. Hint: give every dimension after the batch one "
                f"({len(rest)} of them), keeping the fixed ones as they are"
            )
        shape = given
    return ((batch,) if batched else ()) + shape


def prepare(
    inputs: dict[str, Array], binary: bool, parameters: dict[str, Any] | None = None
) -> tuple[bytes, dict[str, str]]:
    return encode_infer_request(inputs, binary=binary, parameters=parameters)
