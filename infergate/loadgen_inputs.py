"""The requests a load sends: inputs that fit a model's metadata (perf_analyzer's random
data and --shape), encoded once as a V2 request body (binary or JSON tensors)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from infergate.client_codec import MAX_ANSWER_MB, encode_infer_request
from infergate.tensors import Array, numpy_dtype

# The random inputs of one request, at most: as large as the largest answer the client
# reads. The shapes come from the server's metadata, and [-1, 12000, 12000] FP32 took
# 1.7 GB before the first request; --input-data sends inputs of any size.
MAX_SAMPLE_MB = MAX_ANSWER_MB
BYTES_ELEMENT_SIZE = 16  # a made-up BYTES element: b"infergate", its 4-byte length, a pointer


class InputsTooLarge(ValueError):
    """Random inputs larger than MAX_SAMPLE_MB. `from_metadata`: even one row at the
    model's own dimensions is, so the server's metadata is the problem, not --batch or
    --shape."""

    def __init__(self, message: str, from_metadata: bool) -> None:
        super().__init__(message)
        self.from_metadata = from_metadata


def sample_inputs(
    metadata: dict[str, Any],
    batch: int,
    seed: int = 0,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, Array]:
    """Inputs that fit a model's metadata: a leading free dimension is `batch`; the rest of
    the shape comes from `shapes` (perf_analyzer's --shape, without the batch dimension)
    or, for free dimensions, 1; values random in the datatype's range. ValueError for a
    --shape that does not fit; InputsTooLarge past MAX_SAMPLE_MB, checked before any
    is made."""
    specs = _specs(metadata)
    planned = {
        spec["name"]: input_shape(
            spec["name"], spec["shape"], batch, (shapes or {}).get(spec["name"])
        )
        for spec in specs
    }
    check_sample_size(metadata, batch, planned)
    rng = np.random.default_rng(seed)
    return {spec["name"]: _random(rng, spec["datatype"], planned[spec["name"]]) for spec in specs}


def _random(rng: np.random.Generator, datatype: str, shape: tuple[int, ...]) -> Array:
    """Random values of `datatype`, made in that type (FP16 by way of FP32), not by way
    of float64 or int64 arrays up to 8 times its size."""
    if datatype == "BYTES":
        array = np.empty(shape, dtype=object)
        array.fill(b"infergate")
        return array
    dtype = numpy_dtype(datatype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape, dtype=bool)
    if dtype == np.float64:
        return rng.standard_normal(shape)
    if dtype.kind == "f":  # FP32, and FP16 by way of it
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
    return rng.integers(0, 10, shape, dtype=dtype)


def inputs_bytes(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> int:
    """The bytes of the inputs of `metadata` at `shapes` (by input name)."""
    total = 0
    for spec in _specs(metadata):
        datatype = spec["datatype"]
        size = BYTES_ELEMENT_SIZE if datatype == "BYTES" else numpy_dtype(datatype).itemsize
        total += math.prod(shapes[spec["name"]]) * size
    return total


def check_sample_size(
    metadata: dict[str, Any], batch: int, shapes: dict[str, tuple[int, ...]]
) -> None:
    """InputsTooLarge when the inputs at `shapes` are more than MAX_SAMPLE_MB, saying
    whether the model's metadata alone makes them so (one row, free dimensions 1)."""
    cap = MAX_SAMPLE_MB << 20
    size = inputs_bytes(metadata, shapes)
    if size <= cap:
        return
    own = {s["name"]: input_shape(s["name"], s["shape"], 1, None) for s in _specs(metadata)}
    if inputs_bytes(metadata, own) > cap:
        dims = ", ".join(f"{s['name']} {s['datatype']} {s['shape']}" for s in _specs(metadata))
        raise InputsTooLarge(
            f"the model's metadata gives inputs ({dims}) of {_mb(inputs_bytes(metadata, own))} "
            f"for one row, more than the {MAX_SAMPLE_MB} MB of random inputs bench makes up",
            from_metadata=True,
        )
    raise InputsTooLarge(
        f"--batch {batch} and the dimensions of the model's inputs make requests of "
        f"{_mb(size)}, more than the {MAX_SAMPLE_MB} MB of random inputs bench makes up. "
        "Hint: a smaller --batch or --shape, or --input-data FILE for inputs this large",
        from_metadata=False,
    )


def _specs(metadata: dict[str, Any]) -> list[dict[str, Any]]:
    return metadata.get("inputs") or []


def _mb(size: int) -> str:
    return f"{size / 2**20:.4g} MB" if size < 2**60 else f"about 2^{size.bit_length() - 1} bytes"


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
