"""A version's tensor contract on the request path: inputs checked and keyed for
batching, the outputs a request gets, and the answer to a batch of zero rows. The answers
depend only on the tensors' names, datatypes and shapes, so they are kept once final."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import numpy as np

from infergate.engine.repository.spec import TensorSpec
from infergate.engine.scheduling.batching import batch_key
from infergate.engine.scheduling.validate import check_inputs, check_outputs, check_rows
from infergate.tensors import Array, numpy_dtype

_UNCHECKED = object()
_MAX_SIGNATURES = 256  # distinct input signatures remembered per version


class TensorSource(Protocol):
    """Where the tensors come from (a served version: its workers, or a remote server)."""

    name: str

    @property
    def inputs(self) -> tuple[TensorSpec, ...]: ...

    @property
    def outputs(self) -> tuple[TensorSpec, ...]: ...

    @property
    def batchable(self) -> bool: ...

    @property
    def tensors_final(self) -> bool:
        """Whether the tensors are known for good (a worker has loaded the file)."""
        ...


class TensorChecks:
    def __init__(self, source: TensorSource) -> None:
        self._source = source
        # input signature (names, dtypes, shapes) -> its batch key, for inputs found valid
        self._checked: dict[tuple[object, ...], Hashable] = {}
        self._all_outputs: tuple[str, ...] | None = None

    def check_inputs(self, inputs: dict[str, Array]) -> Hashable:
        """Check `inputs` (BadRequest naming what is wrong) and return the key they batch
        under (None: they run alone). A service sends few signatures, so the answer is
        kept per signature once the worker has said what the tensors are."""
        signature = tuple([(name, a.dtype, a.shape) for name, a in inputs.items()])
        key = self._checked.get(signature, _UNCHECKED)
        if key is _UNCHECKED:
            source = self._source
            check_inputs(source.name, source.inputs, inputs)
            if source.batchable:
                check_rows(source.name, inputs)
            key = batch_key(inputs) if source.batchable else None
            if source.tensors_final:
                if len(self._checked) >= _MAX_SIGNATURES:
                    self._checked.clear()
                self._checked[signature] = key
        return key

    def check_outputs(self, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
        """The outputs to compute for a request that asked for `wanted` (None or none
        named: all, as in Triton)."""
        if not wanted:
            wanted = None
        if wanted is None and self._all_outputs is not None:
            return self._all_outputs
        names = check_outputs(self._source.name, self._source.outputs, wanted)
        if wanted is None and self._source.tensors_final:
            self._all_outputs = names
        return names

    def empty_outputs(self, names: tuple[str, ...]) -> dict[str, Array]:
        """The answer to a batch of zero rows, without running it: each output with zero
        rows, its other dimensions as declared (a free one is 0 too, as nothing fills it)."""
        specs = {s.name: s for s in self._source.outputs}
        return {
            n: np.zeros(
                (0, *(max(d, 0) for d in specs[n].shape[1:])), numpy_dtype(specs[n].datatype)
            )
            for n in names
        }
