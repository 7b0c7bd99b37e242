"""Models like Triton's quickstart ones, and one server of them the Triton tests share.

`simple`: INPUT0, INPUT1 INT32 [-1, 16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 -
INPUT1, as Triton's client examples expect it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import write_profile
from tests.onnx_models import OPSET, _save, make_fails_on_demand
from tests.server import ServerProcess


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


# The models of the shared Triton server's folder, which the index must list exactly.
TRITON_MODELS = ("broken", "flaky", "simple", "simple_fixed", "tunable", "versioned")


def build_triton_repository(root: Path) -> Path:
    models = root / "models"
    make_simple(models / "simple" / "1" / "model.onnx")
    (models / "simple" / "labels.txt").write_text("\n".join(f"label{i}" for i in range(16)))
    make_simple(models / "simple_fixed" / "1" / "model.onnx", batch=False)
    make_simple(models / "tunable" / "1" / "model.onnx")
    for version in (1, 2, 3):
        make_simple(models / "versioned" / str(version) / "model.onnx")
    make_fails_on_demand(models / "flaky" / "1" / "model.onnx")
    (models / "broken" / "1").mkdir(parents=True)
    (models / "broken" / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    return models


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server of Triton-like models, with the default profile's batching."""
    folder = tmp_path_factory.mktemp("triton")
    models = build_triton_repository(folder)
    proc = ServerProcess(models, write_profile(folder), folder / "server.log").start()
    yield proc
    proc.stop()
