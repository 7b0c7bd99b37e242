"""A version's instances on in-process fake workers and its scheduler, on a FakeClock: the
seam the timing-rule and batching-policy tests drive."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Self

import numpy as np

from infergate.clock import FakeClock
from infergate.engine.context import EngineContext
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.repository.spec import TensorSpec
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.engine.scheduling.scheduler import Scheduler
from infergate.engine.scheduling.tickets import Timing
from infergate.engine.workers.messages import WorkerSpec
from infergate.tensors import Array
from tests.fake_workers import FakeWorker, FakeWorkers

SPEC = WorkerSpec(
    model="m",
    version=1,
    path=Path("m.scripted"),
    runtime="scripted",
    device="cpu",
    inputs=(TensorSpec("x", "FP32", (-1, 4)),),
    outputs=(TensorSpec("y", "FP32", (-1, 4)), TensorSpec("pid", "INT64", (-1, 1))),
)
Answer = tuple[dict[str, Array], Timing]


class Served:
    """Instances on fake workers and their scheduler, as one ServedVersion holds them."""

    def __init__(self, instances: int, policy: QueuePolicy, **instance_settings: float) -> None:
        self.clock = FakeClock()
        self.workers = FakeWorkers()
        self.context = EngineContext(clock=self.clock, worker_factory=self.workers)
        self.instances = [
            Instance(SPEC, i, self.context, **instance_settings) for i in range(instances)
        ]
        self.scheduler = Scheduler("m", 1, self.instances, policy, self.clock, self.context.metrics)

    async def start(self) -> Self:
        for instance in self.instances:
            instance.start()
        await asyncio.gather(*(i.wait_settled() for i in self.instances))
        return self

    async def stop(self) -> None:
        await self.scheduler.stop()
        await asyncio.gather(*(i.stop() for i in self.instances))

    async def submit(
        self, cls: PriorityClass, rows: int = 1, timeout_s: float = 10.0
    ) -> asyncio.Task[Answer]:
        """Send a request that runs alone; returns once the scheduler has admitted it (and
        started it, when an instance was free): submit does both before its first await."""
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        task = asyncio.create_task(
            self.scheduler.submit({"x": x}, None, ("y", "pid"), cls, cls.deadline_s, timeout_s)
        )
        await asyncio.sleep(0)
        return task

    def worker(self, index: int) -> FakeWorker:
        handle = self.instances[index].handle
        assert isinstance(handle, FakeWorker)
        return handle
