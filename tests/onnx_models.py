"""Small real ONNX models the tests generate: an MLP, an echo of every datatype, and models
that fail inside onnxruntime. A slow, blocking or memory-hungry model is a scripted one
(tests/scripted_runtime.py): its behaviour is set by its input, not by the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 17)]

ECHO_TYPES = {
    "BOOL": TensorProto.BOOL,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def mlp_weights(sizes: tuple[int, ...], seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            (rng.standard_normal(b) * 0.1).astype(np.float32),
        )
        for a, b in zip(sizes[:-1], sizes[1:], strict=False)
    ]


def make_mlp(
    path: Path, sizes: tuple[int, ...] = (4, 8, 3), seed: int = 0, offset: float = 0.0
) -> Path:
    """x [-1, sizes[0]] -> y [-1, sizes[-1]]; `offset` is added to y, so versions differ."""
    nodes, inits = [], []
    current = "x"
    weights = mlp_weights(sizes, seed)
    for i, (w, b) in enumerate(weights):
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"m{i}"]))
        out = f"a{i}"
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [out]))
        if i < len(weights) - 1:
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"]))
            out = f"r{i}"
        current = out
    inits.append(numpy_helper.from_array(np.array([offset], dtype=np.float32), "offset"))
    nodes.append(helper.make_node("Add", [current, "offset"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", sizes[-1]])],
        inits,
    )
    return _save(helper.make_model(graph, opset_imports=OPSET), path)


def make_echo(path: Path) -> Path:
    """One input per V2 datatype (in_<TYPE>, shape [-1, 2]) echoed to out_<TYPE>."""
    inputs, outputs, nodes = [], [], []
    for name, elem in ECHO_TYPES.items():
        inputs.append(helper.make_tensor_value_info(f"in_{name}", elem, ["n", 2]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", elem, ["n", 2]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    graph = helper.make_graph(nodes, "echo", inputs, outputs)
    return _save(helper.make_model(graph, opset_imports=OPSET), path)


def make_fails_on_single_rows(path: Path) -> Path:
    """x [-1, 4] -> y [2, 4]: reshapes to exactly two rows, so a batch of one (as the
    warm-up sends) fails inside onnxruntime while a batch of two works."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "two_rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.array([2, 4], dtype=np.int64), "shape")],
    )
    return _save(helper.make_model(graph, opset_imports=OPSET), path)


def make_fails_on_demand(path: Path) -> Path:
    """mode INT64 [1] -> y FP32 [-1]: reshapes four numbers to shape [mode + 4], so mode 0
    works (and the warm-up's zeros pass) while any other mode fails inside onnxruntime."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["mode", "four"], ["shape"]),
            helper.make_node("Reshape", ["data", "shape"], ["y"]),
        ],
        "fails_on_demand",
        [helper.make_tensor_value_info("mode", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
        [
            numpy_helper.from_array(np.array([4], dtype=np.int64), "four"),
            numpy_helper.from_array(np.arange(4, dtype=np.float32), "data"),
        ],
    )
    return _save(helper.make_model(graph, opset_imports=OPSET), path)
