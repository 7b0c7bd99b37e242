"""One model instance: a small supervisor loop that keeps a worker process alive.

A worker that dies (crash, kill, timeout) is restarted with exponential backoff; the
backoff resets after the worker has stayed up for a while. A file that never loaded is
not retried in a loop: the instance is marked failed with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

from infergate.engine.context import EngineContext
from infergate.engine.workers.handle import WorkerHandle, WorkerLoadError
from infergate.engine.workers.messages import Ready, WorkerSpec

InstanceState = Literal["loading", "ready", "restarting", "failed", "stopped"]


class Instance:
    def __init__(
        self,
        spec: WorkerSpec,
        index: int,
        context: EngineContext,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 10.0,
        stable_after_s: float = 60.0,
    ) -> None:
        self.spec = spec
        self.index = index
        self.state: InstanceState = "loading"
        self.reason: str | None = None
        self.restarts = 0
        self.handle: WorkerHandle | None = None
        self.ready_info: Ready | None = None
        self._context = context
        self._clock = context.clock
        self._load_timeout_s = context.load_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._stable_after_s = stable_after_s
        self._stopping = False
        self._settled = asyncio.Event()  # set once the first load ended, either way
        self._task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.handle is not None and self.handle.alive

    @property
    def pid(self) -> int | None:
        return self.handle.pid if self.handle is not None and self.handle.alive else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"instance:{self.spec.model}")

    async def wait_settled(self) -> None:
        await self._settled.wait()

    async def _supervise(self) -> None:
        backoff = self._backoff_initial_s
        ever_ready = False
        while not self._stopping:
            handle = WorkerHandle(self.spec)
            self.handle = handle
            try:
                self.ready_info = await handle.start(self._load_timeout_s)
            except WorkerLoadError as exc:
                await handle.exited
                if not ever_ready or self._stopping:
                    self._fail(f"load failed: {exc}")
                    return
                self.reason = f"reload after a crash failed: {exc}"
            else:
                ever_ready = True
                self.state, self.reason = "ready", None
                self._settled.set()
                up_since = self._clock.now()
                await handle.exited
                if self._stopping:
                    break
                if self._clock.now() - up_since >= self._stable_after_s:
                    backoff = self._backoff_initial_s
                self.reason = handle.death_reason
                self._context.metrics.worker_restarts.labels(self.spec.model).inc()
                self._context.events.publish(
                    "worker_restarting",
                    self.spec.model,
                    f"instance {self.index}: {handle.death_reason}; restarting in {backoff:.2f} s",
                    self.spec.version,
                    instance=self.index,
                )
            self.state = "restarting"
            self.restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)
        self.state = "stopped"

    def _fail(self, reason: str) -> None:
        self.state, self.reason = "failed", reason
        self._settled.set()

    async def stop(self) -> None:
        self._stopping = True
        if self.handle is not None:
            await self.handle.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.state != "failed":
            self.state = "stopped"
        self._settled.set()
