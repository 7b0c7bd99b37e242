"""Triton's classification extension: an output requested with `parameters.classification
= k` comes back as its top k entries, as BYTES "score:index[:label]", highest first. For a
batching model each row is ranked on its own ([batch, k]); otherwise the whole tensor ([k]).
Labels are the lines of a labels.txt in the model's folder (or its version folder)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from infergate.errors import BadRequest, ConfigError, shown
from infergate.settings.table import read_regular
from infergate.tensors import Array

log = logging.getLogger("infergate.models")

LABELS_FILE = "labels.txt"
# Each entry is a string formatted on the event loop (about 2 us): 2 million of them held
# it for 4 s. 65,536 is any batch of 32,768 rows ranked twice, or 64 rows of 1,000 classes.
MAX_ENTRIES = 65_536
_labels_cache: dict[Path, tuple[float, list[str]]] = {}
# A label a line, one line a class: 4 MiB holds 65,536 labels of 64 bytes (models with
# tens of thousands of classes exist; MAX_ENTRIES bounds what an answer formats, not them).
MAX_LABELS_BYTES = 4 << 20


def _labels(model_file: Path) -> list[str]:
    """labels.txt beside the version folder or in it, re-read when it changes."""
    for folder in (model_file.parent, model_file.parent.parent):
        path = folder / LABELS_FILE
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        cached = _labels_cache.get(path)
        if cached is None or cached[0] != mtime:
            cached = _labels_cache[path] = (mtime, _read_labels(path))
        return cached[1]
    return []


def _read_labels(path: Path) -> list[str]:
    """The lines of a labels file; none, said once in the log until it changes, for a
    file that is not a regular one of at most MAX_LABELS_BYTES: read on the event loop,
    a FIFO there held every tenant's requests until something wrote to it."""
    try:
        data = read_regular(path, MAX_LABELS_BYTES)
    except ConfigError as exc:
        log.warning("classification answers carry no labels: %s", exc)
        return []
    return data.decode("utf-8", errors="replace").splitlines()


def check_classifications(parameters: dict[str, dict[str, Any]]) -> None:
    """400 now, before the model runs, for an output asked for as a classification whose
    count `classify` would refuse."""
    for name, params in parameters.items():
        if params.get("classification"):  # (as `classify_outputs` reads it)
            _count(name, params["classification"])


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(
            f"output {name!r}: parameters.classification must be a positive integer "
            f"(how many top classes to return), got {shown(value)}"
        )
    return value


def _entry(score: Any, index: int, labels: list[str]) -> bytes:
    shown = f"{float(score):f}" if isinstance(score, np.floating) else str(int(score))
    text = f"{shown}:{index}"
    if index < len(labels) and labels[index]:
        text += f":{labels[index]}"
    return text.encode()


def _top(flat: Array, k: int, labels: list[str]) -> list[bytes]:
    order = np.argsort(-flat.astype(np.float64), kind="stable")[:k]
    return [_entry(flat[i], int(i), labels) for i in order]


def classify(name: str, array: Array, value: Any, batching: bool, model_file: Path) -> Array:
    k = _count(name, value)
    if array.dtype.kind not in "biuf":
        raise BadRequest(f"output {name!r} is not numeric; only numeric outputs are classified")
    per_row = batching and array.ndim >= 1
    rows, size = (len(array), array[0].size if len(array) else 0) if per_row else (1, array.size)
    entries = rows * min(k, size)
    if entries > MAX_ENTRIES:
        raise BadRequest(
            f"output {name!r}: classification = {k} over {rows} row(s) of {size} values "
            f"makes {entries} entries; an answer holds at most {MAX_ENTRIES}. Hint: ask "
            "for fewer classes (a smaller k) or send fewer rows per request"
        )
    labels = _labels(model_file)
    if per_row:
        ranked = [_top(row.reshape(-1), k, labels) for row in array]
        width = min(k, int(np.prod(array.shape[1:], dtype=np.int64)))
        table: Array = np.empty((len(ranked), width), dtype=object)
        for i, row in enumerate(ranked):
            table[i, :] = row
        return table
    top = _top(array.reshape(-1), k, labels)
    flat: Array = np.empty(len(top), dtype=object)
    flat[:] = top
    return flat


def classify_outputs(
    outputs: dict[str, Array],
    parameters: dict[str, dict[str, Any]],
    batching: bool,
    model_file: Path,
) -> dict[str, Array]:
    """`outputs` with each one asked for as a classification replaced by its top k."""
    if not parameters:  # the usual case, on every request
        return outputs
    wanted = [n for n, p in parameters.items() if p.get("classification") and n in outputs]
    if not wanted:
        return outputs
    out = dict(outputs)
    for name in wanted:
        value = parameters[name]["classification"]
        out[name] = classify(name, outputs[name], value, batching, model_file)
    return out
