"""`infergate bench`'s arguments checked and read before anything runs: the numeric
options, level ranges (START:END:STEP or a list), --shape, the --input-data file and the
-f CSV file. Every mistake is a usage error (exit 2) that says which argument and why."""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson
import typer

from infergate.cli.common import EXIT_USAGE, fail

if TYPE_CHECKING:  # numpy loads when a bench reads or makes its inputs
    from infergate.tensors import Array

MAX_LEVELS = 1000  # a range that makes more is a typo (1:1000000), not a plan


def check_options(
    *,
    duration: float,
    batch: int,
    max_connections: int,
    max_windows: int,
    windows: int | None,
    stability: float,
    distribution: str,
    as_json: bool,
) -> None:
    """The numeric options and --request-distribution, each in its range."""
    if not 0 < duration < math.inf or batch < 1 or max_connections < 1 or max_windows < 3:
        fail(
            "--duration must be a positive number of seconds (not inf), --batch and "
            "--max-connections at least 1, "
            "--max-windows at least 3",
            EXIT_USAGE,
            as_json,
        )
    if windows is not None and windows < 1:
        fail("--windows must be at least 1", EXIT_USAGE, as_json)
    if not 0 < stability < math.inf:
        fail("--stability-percentage must be a positive number", EXIT_USAGE, as_json)
    if distribution not in ("constant", "poisson"):
        fail(f"--request-distribution {distribution!r}: constant or poisson", EXIT_USAGE, as_json)


def parse_range(text: str, what: str, integer: bool) -> list[float]:
    """perf_analyzer's START:END:STEP (END and STEP optional), or a list like 1,8,32."""
    try:
        if ":" in text:
            parts = [float(x) for x in text.split(":")]
            if len(parts) > 3 or not all(math.isfinite(x) for x in parts):
                raise ValueError
            start, end, step = (parts + [parts[0], 1.0][len(parts) - 1 :])[:3]
            if step <= 0 or end < start:
                raise ValueError
            count = int((end - start) / step + 1e-9) + 1
            if count > MAX_LEVELS:
                raise typer.BadParameter(
                    f"{what}: {text!r} makes {count} levels; at most {MAX_LEVELS}. Hint: a "
                    "larger STEP"
                )
            levels = [start + i * step for i in range(count)]
        else:
            levels = [float(x) for x in text.split(",") if x.strip()]
            if not all(math.isfinite(x) for x in levels):
                raise ValueError
    except ValueError:
        raise typer.BadParameter(
            f"{what}: expected START:END:STEP (like 1:16:4) or numbers separated by commas "
            f"(like 1,8,32), got {text!r}"
        ) from None
    if not levels or any(x <= 0 for x in levels):
        raise typer.BadParameter(f"{what}: expected positive numbers, got {text!r}")
    if integer and any(x != int(x) for x in levels):
        raise typer.BadParameter(f"{what}: a concurrency is a whole number, got {text!r}")
    return levels


def check_shape_names(shapes: dict[str, tuple[int, ...]], metadata: dict[str, Any]) -> None:
    names = [t["name"] for t in metadata.get("inputs") or []]
    for name in shapes:
        if name not in names:
            raise typer.BadParameter(
                f"--shape {name}:...: the model has no input {name!r}; its inputs are "
                f"{', '.join(names) or 'none'}"
            )


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            raise typer.BadParameter(
                f"--shape {item!r}: expected NAME:D1,D2,... (the dimensions after the batch "
                "one, like input:64)"
            ) from None
    return shapes


def _v2_request(path: Path) -> tuple[dict[str, Array], dict[str, Any]]:
    """The inputs and parameters of a V2 JSON request file."""
    import numpy as np

    from infergate.tensors import numpy_dtype

    try:
        doc = orjson.loads(path.read_bytes())
        if not isinstance(doc, dict):
            raise TypeError(f"the file holds a JSON {type(doc).__name__}, not an object")
        inputs: dict[str, Array] = {}
        for t in doc["inputs"]:
            if t["datatype"] == "BYTES":
                flat = [s.encode() if isinstance(s, str) else s for s in t["data"]]
                array = np.array(flat, dtype=object)
            else:
                array = np.array(t["data"], dtype=numpy_dtype(t["datatype"]))
            inputs[t["name"]] = array.reshape(t["shape"])
        parameters = doc.get("parameters") or {}
        return inputs, dict(parameters) if isinstance(parameters, dict) else {}
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise typer.BadParameter(
            f"{path}: not a V2 inference request ({type(exc).__name__}: {exc}). Hint: "
            '{"inputs": [{"name": ..., "datatype": ..., "shape": [...], "data": [...]}]}'
        ) from None


def input_data(path: Path, metadata: dict[str, Any]) -> tuple[dict[str, Array], dict[str, Any]]:
    """--input-data: a .npy (a one-input model), an .npz (arrays named as the inputs), or a
    V2 JSON request."""
    from infergate.cli.npy import sendable

    inputs, parameters = _input_data(path, metadata)
    return {
        n: sendable(f"--input-data {path}: input {n}", a) for n, a in inputs.items()
    }, parameters


def _input_data(path: Path, metadata: dict[str, Any]) -> tuple[dict[str, Array], dict[str, Any]]:
    from infergate.cli.npy import load_npy, load_npz

    if not path.exists():
        raise typer.BadParameter(f"--input-data {path}: no such file")
    if not path.is_file():
        raise typer.BadParameter(f"--input-data {path}: not a regular file (a directory?)")
    names = [t["name"] for t in metadata.get("inputs") or []]
    if path.suffix == ".npy":
        if len(names) != 1:
            raise typer.BadParameter(
                f"--input-data {path}: a .npy feeds a one-input model; this one has "
                f"{', '.join(names)}. Hint: an .npz with one array per input"
            )
        return _batched({names[0]: load_npy(path)}, metadata), {}
    if path.suffix == ".npz":
        return _batched(load_npz(path), metadata), {}
    if path.suffix == ".json":
        return _v2_request(path)
    raise typer.BadParameter(f"--input-data {path}: expected a .npy, .npz or .json file")


def _batched(inputs: dict[str, Array], metadata: dict[str, Any]) -> dict[str, Array]:
    """A single sample (one dimension short of a batching model's shape) becomes a batch of
    one, as `infergate infer` does."""
    import numpy as np

    dims = {t["name"]: t["shape"] for t in metadata.get("inputs") or []}
    out = {}
    for name, array in inputs.items():
        shape = dims.get(name)
        if shape and shape[0] < 0 and array.ndim == len(shape) - 1:
            array = array[np.newaxis]
        out[name] = array
    return out


def open_csv(path: Path | None, as_json: bool) -> IO[str] | None:
    """-f's file, opened before the run: a path that cannot be written must not waste it."""
    if path is None:
        return None
    try:
        return path.open("w", newline="")
    except OSError as exc:
        fail(f"-f {path}: cannot write it ({exc.strerror or exc})", EXIT_USAGE, as_json)
