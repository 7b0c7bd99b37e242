"""Merging requests into one batch along the first dimension, and splitting results back."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from infergate.engine.repository.spec import TensorSpec
from infergate.tensors import Array


def has_batch_dimension(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> bool:
    """True when every input and output has a free first dimension: the batch."""
    specs = (*inputs, *outputs)
    return bool(specs) and all(s.shape and s.shape[0] == -1 for s in specs)


def batch_key(inputs: dict[str, Array]) -> Hashable:
    """Requests merge only when every input has the same datatype and non-batch shape."""
    return tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in inputs.items()))


def rows_of(inputs: dict[str, Array]) -> int:
    return int(next(iter(inputs.values())).shape[0])


def split_rows(inputs: dict[str, Array], size: int) -> list[dict[str, Array]]:
    """Cut a large request into chunks of at most `size` rows."""
    total = rows_of(inputs)
    return [
        {n: a[start : start + size] for n, a in inputs.items()} for start in range(0, total, size)
    ]


def merge(parts: list[dict[str, Array]]) -> dict[str, Array]:
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def unmerge(outputs: dict[str, Array], rows: list[int]) -> list[dict[str, Array]]:
    if len(rows) == 1:
        return [outputs]
    total = sum(rows)
    for name, array in outputs.items():
        if array.shape[:1] != (total,):
            raise ValueError(
                f"output {name!r} has shape {list(array.shape)} for a batch of {total} rows; "
                "its first dimension is not a batch dimension. Hint: set max_batch_size = 0 "
                "under [batching] in model.toml"
            )
    # Plain slices (views), not np.split: that is Python code costing a few µs per piece.
    pieces = []
    start = 0
    for count in rows:
        end = start + count
        pieces.append({name: array[start:end] for name, array in outputs.items()})
        start = end
    return pieces
