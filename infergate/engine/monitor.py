"""The memory monitor: samples each worker's memory on its device and kills a worker past
its limit (the instance restarts it with backoff, or gives up after repeated kills)."""

from __future__ import annotations

import asyncio
import contextlib

from infergate.engine.context import EngineContext
from infergate.engine.registry import Registry


class MemoryMonitor:
    def __init__(self, registry: Registry, context: EngineContext) -> None:
        self._registry = registry
        self._context = context
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="memory-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def sample(self) -> None:
        """One look at every worker that has a memory limit."""
        backend = self._context.devices
        for record in self._registry.records():
            for served in list(record.versions.values()):
                for instance in served.instances:
                    limit = instance.placement.memory_mb if instance.placement else None
                    pid = instance.pid
                    if not limit or pid is None:
                        continue
                    usage = backend.process(pid)
                    if usage is not None and usage.memory_mb > limit:
                        instance.kill_over_memory(usage.memory_mb, limit)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._context.monitor_interval_s)
            self.sample()
