"""Request tensors against a model's: an empty batch passes (the engine answers it without
the worker); any other tensor without elements is a 400 that says why."""

from __future__ import annotations

import numpy as np
import pytest

from infergate.engine.repository.spec import TensorSpec
from infergate.engine.scheduling.validate import check_inputs
from infergate.errors import BadRequest
from infergate.tensors import Array

SPECS = (TensorSpec("a", "FP32", (-1, -1)), TensorSpec("b", "INT64", (-1, 1)))


def test_an_empty_batch_passes() -> None:
    check_inputs("m", SPECS, {"a": np.zeros((0, 3), np.float32), "b": np.zeros((0, 1), np.int64)})


def test_an_empty_tensor_that_is_not_an_empty_batch_is_refused() -> None:
    inputs: dict[str, Array] = {"a": np.zeros((2, 0), np.float32), "b": np.zeros((2, 1), np.int64)}
    with pytest.raises(BadRequest, match=r"input 'a' has shape \[2, 0\], which holds no"):
        check_inputs("m", SPECS, inputs)
