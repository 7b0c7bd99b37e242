"""Models like Triton's quickstart ones; `triton_server` in conftest.py serves them to the
Triton tests.

`simple`: INPUT0, INPUT1 INT32 [-1, 16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 -
INPUT1, as Triton's client examples expect it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.onnx_models import OPSET, _save, make_fails_on_demand


def make_simple(path: Path, batch: bool = True) -> Path:
    """Triton's `simple`; without `batch` the shape is fixed at [1, 16]."""
    first: str | int = "batch" if batch else 1
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [
            helper.make_tensor_value_info(n, TensorProto.INT32, [first, 16])
            for n in ("INPUT0", "INPUT1")
        ],
        [
            helper.make_tensor_value_info(n, TensorProto.INT32, [first, 16])
            for n in ("OUTPUT0", "OUTPUT1")
        ],
    )
    model: onnx.ModelProto = helper.make_model(graph, opset_imports=OPSET)
    return _save(model, path)


def make_simple_string(path: Path) -> Path:
    """Triton's `simple_string`: INPUT0, INPUT1 BYTES [-1, 16] holding integers as text ->
    OUTPUT0 (sum) and OUTPUT1 (difference), as text."""
    # "0" in front of each string: the warm-up sends empty strings, which Cast refuses.
    zero = numpy_helper.from_array(np.array(["0"], dtype=object), "zero")
    nodes = [
        helper.make_node("StringConcat", ["zero", "INPUT0"], ["text0"]),
        helper.make_node("StringConcat", ["zero", "INPUT1"], ["text1"]),
        helper.make_node("Cast", ["text0"], ["a"], to=TensorProto.INT32),
        helper.make_node("Cast", ["text1"], ["b"], to=TensorProto.INT32),
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Sub", ["a", "b"], ["difference"]),
        helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
        helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=TensorProto.STRING),
    ]
    graph = helper.make_graph(
        nodes,
        "simple_string",
        [
            helper.make_tensor_value_info(n, TensorProto.STRING, ["batch", 16])
            for n in ("INPUT0", "INPUT1")
        ],
        [
            helper.make_tensor_value_info(n, TensorProto.STRING, ["batch", 16])
            for n in ("OUTPUT0", "OUTPUT1")
        ],
        [zero],
    )
    opset = [helper.make_opsetid("", 20)]  # StringConcat
    model: onnx.ModelProto = helper.make_model(graph, opset_imports=opset)
    return _save(model, path)


# The models of the shared Triton server's folder, which the index must list exactly.
TRITON_MODELS = (
    "broken",
    "flaky",
    "simple",
    "simple_fixed",
    "simple_string",
    "tunable",
    "versioned",
)


def build_triton_repository(root: Path) -> Path:
    models = root / "models"
    make_simple(models / "simple" / "1" / "model.onnx")
    (models / "simple" / "labels.txt").write_text("\n".join(f"label{i}" for i in range(16)))
    make_simple(models / "simple_fixed" / "1" / "model.onnx", batch=False)
    make_simple_string(models / "simple_string" / "1" / "model.onnx")
    make_simple(models / "tunable" / "1" / "model.onnx")
    for version in (1, 2, 3):
        make_simple(models / "versioned" / str(version) / "model.onnx")
    make_fails_on_demand(models / "flaky" / "1" / "model.onnx")
    (models / "broken" / "1").mkdir(parents=True)
    (models / "broken" / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    return models
