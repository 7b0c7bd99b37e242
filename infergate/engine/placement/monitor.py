"""The monitors: each worker's memory on its device (a worker past its limit is killed, and
the instance restarts it with backoff, or gives up after repeated kills), from the moment
it starts loading; and the event loop's own lag, exported as a metric.

It reads the engine's frozen snapshot of its workers (engine/snapshots.py WorkerView), not
the live instances, and asks for a kill through one command, which acts only if the
worker it sampled is still the one running. Sampling reads /proc or NVML, which can stall,
so it runs in a thread; only the kills run on the loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from infergate.engine.context import EngineContext
from infergate.engine.snapshots import WorkerView

LAG_INTERVAL_S = 0.25


class MemoryMonitor:
    def __init__(
        self,
        workers: Callable[[], list[WorkerView]],
        kill: Callable[[WorkerView, float, float], None],
        context: EngineContext,
    ) -> None:
        self._workers = workers  # a snapshot of every live worker that has a memory limit
        self._kill = kill  # kills a worker over its limit, if it still runs as sampled
        self._context = context
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name="memory-monitor"),
            asyncio.create_task(self._lag(), name="loop-lag"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _usage(self, pids: list[int]) -> list[float | None]:
        backend = self._context.devices
        out: list[float | None] = []
        for pid in pids:
            usage = backend.process(pid)
            out.append(usage.memory_mb if usage is not None else None)
        return out

    async def sample(self) -> None:
        """One look at every worker that has a memory limit, loading ones included: its
        own, or its tenant's quota, which a tenant's workers without one share: past it,
        the one that grew most is killed (one a look: the next look sees what that freed)."""
        watched = self._workers()
        if not watched:
            self._context.placer.unreserved_mb = {}
            return
        used = await asyncio.to_thread(self._usage, [w.pid for w in watched])
        shared: dict[str, list[tuple[float, WorkerView]]] = {}
        for worker, mb in zip(watched, used, strict=True):
            if mb is None:
                continue
            if worker.tenant is not None:
                shared.setdefault(worker.tenant, []).append((mb, worker))
            elif mb > worker.memory_limit_mb:
                self._kill(worker, mb, 0.0)
        self._context.placer.unreserved_mb = {
            tenant: sum(mb for mb, _ in workers) for tenant, workers in shared.items()
        }
        for workers in shared.values():
            together = sum(mb for mb, _ in workers)
            if together > workers[0][1].tenant_left_mb:
                mb, chosen = self._over_quota(workers, together)
                self._kill(chosen, mb, together)

    def _over_quota(
        self, workers: list[tuple[float, WorkerView]], together: float
    ) -> tuple[float, WorkerView]:
        """Which of a tenant's workers past its shared quota goes. A loading one, when
        that brings them under: a reload's new worker beside the serving one fails its
        load, as a reservation without room would refuse it (killed, the serving one
        failed its requests). Else the one that grew most past its size when it became
        ready (loaded and warm, before any request: no request can set it): the one whose
        requests took the memory. The largest went, and a tenant's requests to a model it
        shares grew that model's workers, and the owner's idle model, the largest, was
        killed until it failed; and the least size seen was no better, a request sent as
        the worker came up making its first sample its usual size."""
        loading = [pair for pair in workers if pair[1].loading]
        if loading and together - sum(mb for mb, _ in loading) <= workers[0][1].tenant_left_mb:
            return max(loading, key=lambda p: p[0])

        def growth(pair: tuple[float, WorkerView]) -> tuple[float, float]:
            mb, w = pair
            return mb - (mb if w.ready_mb is None else w.ready_mb), mb

        return max(workers, key=growth)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._context.monitor_interval_s)
            await self.sample()

    async def _lag(self) -> None:
        """How late a timer fires: the time anything else on the loop waits for its turn.
        Measured on the wall's monotonic clock on purpose: it is the real loop's lag."""
        gauge = self._context.metrics.loop_lag
        while True:
            before = time.monotonic()
            await asyncio.sleep(LAG_INTERVAL_S)
            lag = max(0.0, time.monotonic() - before - LAG_INTERVAL_S)
            gauge.set(lag)
            self._context.metrics.loop_lag_seconds.observe(lag)
