"""A caller that gives up, in-process against a real (scripted) worker: its batch keeps
running on the worker, the instance takes no other batch until the reply is in, the
batch's other callers get their rows, and nothing is killed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.inference import InferenceRequest, InferenceResult
from infergate.engine.lifecycle.served import ServedVersion
from infergate.tensors import Array
from tests.scripted_runtime import make_scripted


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    models = tmp_path / "models"
    make_scripted(models / "m" / "1" / "model.scripted", ("hold",), gate_dir=tmp_path)
    (models / "m" / "model.toml").write_text("[batching]\nmax_queue_delay_ms = 0\n")
    engine = Engine(EngineSettings(models_dir=models, model_control="explicit"), EngineContext())
    await engine.start()
    try:
        while not (engine.ready and engine.model("m").state == "ready"):
            await asyncio.sleep(0.05)  # polling the engine's own state, not a delay
        yield engine
    finally:
        await engine.stop()


def request(x: float, hold: int) -> InferenceRequest:
    inputs: dict[str, Array] = {
        "x": np.full((1, 4), x, np.float32),
        "hold": np.full((1, 1), hold, np.int64),
    }
    return InferenceRequest("m", inputs)


async def settle() -> None:
    """Let every ready task run up to its next real wait (the engine's submit path does
    not await before it hands a batch to the worker)."""
    for _ in range(5):
        await asyncio.sleep(0)


def waiting(served: ServedVersion) -> int:
    return sum(served.depth_by_class().values())


async def cancelled(task: asyncio.Task[InferenceResult]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_caller_that_gives_up_leaves_its_batch_running(
    engine: Engine, tmp_path: Path
) -> None:
    served = engine.version("m")
    pid = served.instances[0].pid
    alone = asyncio.create_task(engine.infer(request(1.0, hold=1)))
    await settle()
    await cancelled(alone)  # it gave up while its batch ran on the worker
    after = asyncio.create_task(engine.infer(request(2.0, hold=0)))
    await settle()
    assert waiting(served) == 1  # the worker is still busy: the next request waits
    (tmp_path / "release-1").touch()
    result = await after
    assert result.outputs["y"].tolist() == [[2.0] * 4]
    assert served.instances[0].pid == pid  # nothing was killed


async def test_the_other_callers_of_a_batch_get_their_rows(engine: Engine, tmp_path: Path) -> None:
    served = engine.version("m")
    holder = asyncio.create_task(engine.infer(request(0.0, hold=2)))
    await settle()
    quitter = asyncio.create_task(engine.infer(request(3.0, hold=3)))
    stayer = asyncio.create_task(engine.infer(request(4.0, hold=0)))
    await settle()
    assert waiting(served) == 2
    (tmp_path / "release-2").touch()
    await holder
    while waiting(served):  # the two now run as one batch, held by gate 3
        await asyncio.sleep(0.01)
    await cancelled(quitter)
    (tmp_path / "release-3").touch()
    result = await stayer
    assert result.outputs["y"].tolist() == [[4.0] * 4]
    assert result.outputs["rows"].tolist() == [[2]]  # it ran in the batch of two
