"""ONNX models for sequence tests, as Triton's sequence examples expect them.

`start_flag`: OUTPUT = INPUT + START (Triton's simple_sequence example checks exactly
this: the first answer is its input plus one). `accumulator`: OUTPUT = INPUT + STATE_IN,
STATE_OUT = OUTPUT (a running sum kept in implicit state). `corrid_sum`: OUTPUT = INPUT +
CORRID. All INT32 [-1, 1]."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from tests.onnx_models import OPSET, _save


def _int32(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 1])


def make_start_flag(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT", "START"], ["OUTPUT"])],
        "start_flag",
        [_int32("INPUT"), _int32("START")],
        [_int32("OUTPUT")],
    )
    model: onnx.ModelProto = helper.make_model(graph, opset_imports=OPSET)
    return _save(model, path)


def make_accumulator(path: Path) -> Path:
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT", "STATE_IN"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        ],
        "accumulator",
        [_int32("INPUT"), _int32("STATE_IN")],
        [_int32("OUTPUT"), _int32("STATE_OUT")],
    )
    model: onnx.ModelProto = helper.make_model(graph, opset_imports=OPSET)
    return _save(model, path)


def make_corrid_sum(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT", "CORRID"], ["OUTPUT"])],
        "corrid_sum",
        [_int32("INPUT"), _int32("CORRID")],
        [_int32("OUTPUT")],
    )
    model: onnx.ModelProto = helper.make_model(graph, opset_imports=OPSET)
    return _save(model, path)


START_FLAG_TOML = '[sequence]\nidle_timeout_ms = 600000\nstart = "START"\n'
ACCUMULATOR_TOML = (
    "[sequence]\nidle_timeout_ms = 600000\n"
    '[[sequence.state]]\ninput = "STATE_IN"\noutput = "STATE_OUT"\n'
)
# Two live sequences at most: a start that failed and stayed would show at once.
CORRID_SUM_TOML = '[sequence]\nidle_timeout_ms = 600000\nmax_sequences = 2\ncorrid = "CORRID"\n'
