"""What an Instance and the scheduler need of a worker: the seam where tests put an
in-process fake whose replies they control (tests/fake_workers.py). WorkerHandle, a real
process, is the one the engine makes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from infergate.engine.workers.messages import Ready, WorkerSpec
from infergate.tensors import Array


class Worker(Protocol):
    exited: asyncio.Future[None]  # done once the worker is gone
    death_reason: str
    over_memory: bool

    @property
    def pid(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    async def start(self, timeout_s: float) -> Ready: ...

    def begin(
        self,
        inputs: dict[str, Array],
        outputs: list[str],
        on_reply: Callable[[], None] | None = None,
    ) -> asyncio.Future[dict[str, Array]]: ...

    async def wait(
        self,
        future: asyncio.Future[dict[str, Array]],
        timeout_s: float,
        *,
        limit_s: float | None = None,
    ) -> dict[str, Array]: ...

    def kill_over_memory(self, why: str) -> None: ...

    async def stop(self, grace_s: float = 5.0) -> None: ...


WorkerFactory = Callable[[WorkerSpec], Worker]
