"""A worker's outputs are copied out of its shared-memory arena before its next call can
reuse it: small ones in the pipe reader, on the event loop; large ones on a thread
(engine/workers/handle.py), so that 60 MB of output does not hold every other client for
the copy (40 to 900 ms with its page faults). A real worker process and its arenas."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from infergate.engine.repository.spec import TensorSpec
from infergate.engine.workers import handle, starting
from infergate.engine.workers.handle import COPY_HERE_BYTES, WorkerHandle
from infergate.engine.workers.messages import TensorRef, WorkerSpec
from infergate.tensors import Array
from tests.onnx_models import OPSET, _save
from tests.polling import eventually


def _identity(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "id", [x], [y])
    return _save(helper.make_model(graph, opset_imports=OPSET), path)


BIG = np.arange(COPY_HERE_BYTES // 4 + 1, dtype=np.float32)


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[WorkerHandle]:
    """A worker whose output arena has grown to hold BIG (the first large outputs come
    inline on the pipe, and the arena grows for the next)."""
    path = _identity(tmp_path / "id.onnx")
    spec = WorkerSpec(
        model="id",
        version=1,
        path=path,
        runtime="onnx",
        device="cpu",
        inputs=(TensorSpec("x", "FP32", (-1,)),),
        outputs=(TensorSpec("y", "FP32", (-1,)),),
        threads=1,
    )
    started = WorkerHandle(spec)
    await started.start(60)
    await started.wait(started.begin({"x": BIG}, ["y"]), 60)
    try:
        yield started
    finally:
        await started.stop(5)
        await starting.stop()


async def test_large_outputs_are_copied_on_a_thread_small_ones_in_the_reader(
    worker: WorkerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    copied_on: list[str] = []
    copy_out = handle._copy_out

    def recorded(buf: memoryview, refs: tuple[TensorRef, ...]) -> dict[str, Array]:
        copied_on.append(threading.current_thread().name)
        return copy_out(buf, refs)

    monkeypatch.setattr(handle, "_copy_out", recorded)
    small = np.arange(1024, dtype=np.float32)
    outputs = await worker.wait(worker.begin({"x": small}, ["y"]), 30)
    assert outputs["y"].tolist() == small.tolist()
    assert copied_on == []  # in the pipe reader, on the loop's own thread
    big = BIG
    replied: list[bool] = []
    call = worker.begin({"x": big}, ["y"], on_reply=lambda: replied.append(True))
    outputs = await worker.wait(call, 60)
    assert np.array_equal(outputs["y"], big)
    assert len(copied_on) == 1
    assert copied_on[0] != threading.current_thread().name
    assert replied == [True]  # the next batch is sent once the arena is free again
    # A copy, not a view of the arena: the next call's outputs do not change it.
    again = await worker.wait(worker.begin({"x": big * 2}, ["y"]), 60)
    assert np.array_equal(again["y"], big * 2)
    assert np.array_equal(outputs["y"], big)


async def test_an_exit_while_outputs_are_copied_closes_the_arenas_after_the_copy(
    worker: WorkerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker killed while its large outputs are being copied: its arenas close once
    the copy is done (closing them under it raised BufferError in the exit), and the call
    still gets the outputs the worker had written."""
    release = threading.Event()
    copy_out = handle._copy_out

    def held(buf: memoryview, refs: tuple[TensorRef, ...]) -> dict[str, Array]:
        release.wait(30)
        return copy_out(buf, refs)

    monkeypatch.setattr(handle, "_copy_out", held)
    big = BIG
    call = worker.begin({"x": big}, ["y"])
    await eventually(lambda: worker._copying or None, what="the copy to begin")
    worker.kill("a test kills it mid-copy")
    await worker.exited
    release.set()
    outputs = await worker.wait(call, 30)
    assert np.array_equal(outputs["y"], big)
    assert not worker._copying
