"""The Runtime seam: open a model file on a device, describe it, run a batch.

Runtimes live only in worker processes; the gateway never imports onnxruntime or torch.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from infergate.engine.repository.spec import TensorSpec, Warmup
from infergate.errors import RuntimeUnavailable as RuntimeUnavailable  # raised here
from infergate.errors import WarmupInputError as WarmupInputError  # raised here
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


def warmup_inputs(specs: tuple[TensorSpec, ...], warmup: Warmup) -> dict[str, Array] | None:
    """The inputs model.toml's [warmup] asks for; None: no warm-up run."""
    if warmup.data == "none":
        return None
    if warmup.data == "random":
        return _random_inputs(specs, warmup.low, warmup.high)
    if warmup.data == "file":
        assert warmup.file is not None  # modelconfig requires it
        return _file_inputs(specs, warmup.file, warmup.folder)
    return sample_inputs(specs)


def _random_inputs(specs: tuple[TensorSpec, ...], low: float, high: float) -> dict[str, Array]:
    rng = np.random.default_rng(0)  # the same input every time: a failure reproduces
    out: dict[str, Array] = {}
    for spec in specs:
        shape = tuple(1 if d < 0 else d for d in spec.shape)
        if spec.datatype == "BYTES":
            numbers = rng.integers(int(low), int(high) + 1, size=shape)
            out[spec.name] = np.vectorize(lambda v: str(v).encode(), otypes=[object])(numbers)
        elif spec.datatype == "BOOL":
            out[spec.name] = rng.random(shape) < 0.5
        else:
            dtype = numpy_dtype(spec.datatype)
            values: Array = (
                rng.integers(int(np.ceil(low)), int(np.floor(high)) + 1, size=shape)
                if np.issubdtype(dtype, np.integer)
                else rng.uniform(low, high, size=shape)
            )
            out[spec.name] = values.astype(dtype)
    return out


# A warm-up is one run of a few rows: a file of 3 million rows, read at each restart, held
# a load slot until the load timeout.
WARMUP_FILE_MAX_BYTES = 64 * 2**20


def _file_inputs(
    specs: tuple[TensorSpec, ...], path: Path, folder: Path | None
) -> dict[str, Array]:
    with os.fdopen(_open_sample(path, folder), "rb") as sample:
        names = [s.name for s in specs]
        arrays: dict[str, Any]
        if path.suffix == ".npy":
            if len(specs) != 1:
                raise WarmupInputError(
                    f"warm-up file {path} holds one array but the model has inputs "
                    f"{', '.join(names)}; use a .npz with one array per input name"
                )
            arrays = {names[0]: np.load(sample, allow_pickle=False)}
        elif path.suffix == ".npz":
            with np.load(sample, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        else:
            arrays = _v2_json(path, sample.read())
    missing = [n for n in names if n not in arrays]
    if missing:
        raise WarmupInputError(
            f"warm-up file {path} has no {', '.join(missing)}; it has "
            f"{', '.join(sorted(arrays)) or 'nothing'}"
        )
    out: dict[str, Array] = {}
    for spec in specs:
        value = np.asarray(arrays[spec.name])
        if spec.datatype != "BYTES":
            value = value.astype(numpy_dtype(spec.datatype))
        out[spec.name] = value
    return out


def _open_sample(path: Path, folder: Path | None) -> int:
    """An fd of the warm-up file, once it is a regular file of at most
    WARMUP_FILE_MAX_BYTES that lies in the model's `folder`, as opened (a link out of it
    read any file of the host's, its array names in the error). Checked on the open file,
    so a link swapped meanwhile changes nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise WarmupInputError(f"warm-up file {path} does not exist") from None
    except OSError as exc:
        raise WarmupInputError(f"warm-up file {path} cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WarmupInputError(f"warm-up file {path} is not a regular file")
        if folder is not None:
            opened = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if not opened.is_relative_to(folder.resolve()):
                raise WarmupInputError(
                    f"warm-up file {path} is a link out of the model's folder; a warm-up "
                    "file must lie in it"
                )
        if st.st_size > WARMUP_FILE_MAX_BYTES:
            raise WarmupInputError(
                f"warm-up file {path} holds {st.st_size / 2**20:,.0f} MiB, over the "
                f"{WARMUP_FILE_MAX_BYTES >> 20} MiB a warm-up file may hold; keep a few rows"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _v2_json(path: Path, text: bytes) -> dict[str, Any]:
    """The inputs of a V2 (KServe) JSON inference request (`text`, read from `path`)."""
    try:
        body = json.loads(text)
        arrays = {}
        for item in body["inputs"]:
            if item["datatype"] == "BYTES":
                flat = [v.encode() if isinstance(v, str) else bytes(v) for v in item["data"]]
                array = np.empty(len(flat), dtype=object)
                array[:] = flat
            else:
                array = np.asarray(item["data"], dtype=numpy_dtype(item["datatype"]))
            arrays[item["name"]] = array.reshape(item["shape"])
        return arrays
    except (ValueError, KeyError, TypeError) as exc:
        raise WarmupInputError(
            f"warm-up file {path} is not a V2 JSON request "
            f'({{"inputs": [{{"name", "datatype", "shape", "data"}}]}}): {exc}'
        ) from None
