"""One model instance: a small supervisor loop that keeps a worker process alive.

A worker that dies (crash, kill, timeout) is restarted with exponential backoff; the
backoff resets after the worker has stayed up for a while. A file that never loaded is
not retried in a loop: the instance is marked failed with the reason. A process that could
not even be started (out of fds, memory, processes: the machine's fault, not the model's)
is retried with backoff and jitter, each failure an event; a first load gives up after the
load timeout. At most `max_concurrent_loads` workers load at once, gateway-wide; a
restart of a worker that served goes first, past them by a few (load_slots.py), unless
its last restart failed to load (a crash loop keeps no place ahead of others' loads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Literal

from infergate.engine.context import EngineContext
from infergate.engine.placement.placer import Placement
from infergate.engine.workers.handle import WorkerLoadError, WorkerStartError
from infergate.engine.workers.messages import Ready, WorkerSpec
from infergate.engine.workers.protocol import Worker

log = logging.getLogger("infergate.instance")

InstanceState = Literal["loading", "ready", "restarting", "failed", "stopped"]


class Instance:
    def __init__(
        self,
        spec: WorkerSpec,
        index: int,
        context: EngineContext,
        tenant: Hashable = None,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 10.0,
        stable_after_s: float = 60.0,
    ) -> None:
        self.spec = spec
        self.index = index
        self.tenant = tenant  # whose load slots it takes (load_slots.py)
        self.state: InstanceState = "loading"
        self.reason: str | None = None
        self.restarts = 0
        self.batches = 0  # batches run, for the dashboard and for affinity checks
        self.handle: Worker | None = None
        self.ready_info: Ready | None = None
        self.ready_mb: float | None = None  # its worker's memory when it became ready
        self._context = context
        self._clock = context.clock
        self._load_timeout_s = context.load_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._stable_after_s = stable_after_s
        # The backoff the next restart waits (`_keep_alive` doubles and resets it), and for
        # `back_in_s` when the worker came up last and how long its start and load took.
        self._backoff = backoff_initial_s
        self._up_since: float | None = None
        self._load_s = 0.0
        self._stopping = False
        self._kills: list[float] = []
        # A batch is on the worker (the runner says so): a memory kill now is that batch's
        # doing, answered 503 to its callers and judged by the breaker (which cuts off a
        # tenant whose requests alone do it), not the model's own growth: it does not
        # count toward max_kills, or one tenant's requests would fail the model for all.
        self.running = False
        self._killed_running = False
        self.placement: Placement | None = None
        self._settled = asyncio.Event()  # set once the first load ended, either way
        # Called each time a worker becomes ready (its scheduler looks at its queue again:
        # a request pinned to this instance waits for it through a restart).
        self.on_ready: Callable[[], None] = lambda: None
        # Called when it fails for good (its scheduler answers what can no longer run).
        self.on_failed: Callable[[], None] = lambda: None
        # Called when a request of a tenant (None: unnamed), running alone, ended this
        # instance's worker, with what ended it: its version's breaker counts it against
        # the tenant (a query of death), and says whether the request may run again.
        self.on_ended_by: Callable[[Hashable, str], bool] = lambda tenant, how: True
        self._task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        handle = self.handle  # (`handle.alive` inlined: asked several times a request)
        return self.state == "ready" and handle is not None and not handle.exited.done()

    @property
    def pid(self) -> int | None:
        return self.handle.pid if self.handle is not None and self.handle.alive else None

    def place(self, placement: Placement) -> None:
        """Where the worker goes: its runtime device, environment and memory cap."""
        self.placement = placement
        self.spec = replace(
            self.spec,
            device=placement.runtime_device,
            env=placement.env,
            memory_mb=placement.memory_mb,
            threads=placement.threads,
            cpus=placement.cpus,
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"instance:{self.spec.model}")

    async def wait_settled(self) -> None:
        await self._settled.wait()

    @property
    def _key(self) -> tuple[str, int, int]:
        return (self.spec.model, self.spec.version, id(self))

    async def _supervise(self) -> None:
        try:
            await self._keep_alive()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave the instance loading for good
            log.exception("instance %s:%s supervisor failed", self.spec.model, self.index)
            self._fail(f"internal error supervising the worker: {type(exc).__name__}: {exc}")
            self._context.events.publish(
                "model_load_failed", self.spec.model, self.reason or "", self.spec.version
            )
        finally:
            self._context.start_failing.pop(self._key, None)

    async def _start(self, restart: bool) -> tuple[Worker, Ready]:
        """A started worker, loaded and warm; waits for a load slot first (`restart`: of
        a worker that served, it takes one at once)."""
        async with self._context.load_slots.slot(self.tenant, restart):
            handle = self._context.worker_factory(self.spec)
            self.handle = handle
            ready = await handle.start(self._load_timeout_s)
        self._context.start_failing.pop(self._key, None)
        return handle, ready

    def _start_failed(self, exc: WorkerStartError, backoff: float) -> None:
        why = f"could not start a worker process ({exc})"
        self._context.start_failing[self._key] = f"model {self.spec.model!r}: {why}"
        self._context.metrics.worker_start_failures.labels(self.spec.model).inc()
        self._context.events.publish(
            "worker_start_failed",
            self.spec.model,
            f"instance {self.index}: {why}; retrying in {backoff:.2f} s",
            self.spec.version,
            instance=self.index,
        )
        self.reason = f"{why}; retrying"

    def back_in_s(self) -> float:
        """About how long a worker of this instance that died now would take to be ready
        again (at most: the backoff's jitter included), by its last start."""
        backoff = self._backoff
        up_since = self._up_since
        if up_since is not None and self._clock.now() - up_since >= self._stable_after_s:
            backoff = self._backoff_initial_s  # (as `_keep_alive` will find)
        return backoff * 1.25 + self._load_s

    async def _keep_alive(self) -> None:
        self._backoff = self._backoff_initial_s
        ever_ready = False
        restart_failed = False  # the last restart of a worker that served did not load
        first_try = self._clock.now()
        while not self._stopping:
            try:
                starting = self._clock.now()
                handle, ready = await self._start(restart=ever_ready and not restart_failed)
                self._load_s = self._clock.now() - starting
            except WorkerStartError as exc:
                self._start_failed(exc, self._backoff)
                if not ever_ready and self._clock.now() - first_try >= self._load_timeout_s:
                    self._fail(
                        f"no worker process could be started within the load timeout "
                        f"({self._load_timeout_s:.0f} s): {exc}. Hint: the machine is short of "
                        "file descriptors, memory or processes; fix that, then infergate model "
                        f"load {self.spec.model}"
                    )
                    return
                await self._pause(self._backoff, "restarting" if ever_ready else "loading")
                self._backoff = min(self._backoff * 2, self._backoff_max_s)
                continue
            except WorkerLoadError as exc:
                failed = self.handle
                assert failed is not None
                await failed.exited
                if not ever_ready or self._stopping:
                    self._fail(f"load failed: {with_hint(self._said(exc), failed.over_memory)}")
                    return
                self.reason = f"reload after a crash failed: {self._said(exc)}"
                restart_failed = True
                if failed.over_memory and self._too_many_kills():
                    return
            else:
                if self.placement is not None:
                    self._context.devices.assign(ready.pid, self.placement.device)
                self.ready_mb = await self._memory_now(ready.pid)
                self.ready_info = ready
                ever_ready, restart_failed = True, False
                self._killed_running = False
                self.state, self.reason = "ready", None
                self._settled.set()
                self.on_ready()
                up_since = self._up_since = self._clock.now()
                await handle.exited
                if self._stopping:
                    break
                if self._clock.now() - up_since >= self._stable_after_s:
                    self._backoff = self._backoff_initial_s
                self.reason = handle.death_reason
                if handle.over_memory and not self._killed_running and self._too_many_kills():
                    return
                self._context.metrics.worker_restarts.labels(self.spec.model).inc()
                self._context.events.publish(
                    "worker_restarting",
                    self.spec.model,
                    f"instance {self.index}: {handle.death_reason}; restarting in "
                    f"{self._backoff:.2f} s",
                    self.spec.version,
                    instance=self.index,
                )
            self.restarts += 1
            await self._pause(self._backoff, "restarting")
            self._backoff = min(self._backoff * 2, self._backoff_max_s)
        self.state = "stopped"

    async def _memory_now(self, pid: int) -> float | None:
        """What the worker uses loaded and warm, before any request: its usual size, from
        which the memory monitor tells its growth (placement/monitor.py). None when the
        device backend cannot say."""
        try:
            usage = await asyncio.to_thread(self._context.devices.process, pid)
        except Exception:  # (NVML may fail for a process: then its growth is unknown)
            return None
        return usage.memory_mb if usage is not None else None

    async def _pause(self, backoff: float, state: InstanceState) -> None:
        """Wait before the next try; the jitter keeps many instances that failed together
        (a shortage hits them all) from retrying in step."""
        self.state = state
        await asyncio.sleep(backoff * random.uniform(0.75, 1.25))

    def kill_over_memory(
        self, used_mb: float, limit_mb: float, tenant: str | None = None, tenant_mb: float = 0.0
    ) -> None:
        """The monitor saw this worker past its limit: kill it (its requests get 503).
        Its own limit, or (`tenant`) what its tenant's quota leaves the tenant's workers
        without a limit of their own, which together used `tenant_mb`."""
        if self.handle is None or not self.handle.alive:
            return
        self._killed_running = self.running
        if tenant is None:
            said = f"used {used_mb:.0f} MB, over its limit of {limit_mb:.0f} MB"
            why = (
                f"it used {used_mb:.0f} MB, over its memory limit of {limit_mb:.0f} MB "
                "(memory_mb in model.toml)"
            )
        else:
            said = (
                f"used {used_mb:.0f} MB, one of tenant {tenant!r}'s workers without a "
                f"memory_mb of their own, which used {tenant_mb:.0f} MB together, over the "
                f"{limit_mb:.0f} MB its memory quota leaves them"
            )
            why = (
                f"it {said} (memory_mb of [tenants.{tenant}] in the profile). Hint: set "
                "memory_mb in model.toml to reserve the model's share of the quota"
            )
        self.handle.kill_over_memory(why)
        self._context.metrics.worker_kills.labels(self.spec.model, "memory").inc()
        self._context.events.publish(
            "worker_killed",
            self.spec.model,
            f"instance {self.index} {said}",
            self.spec.version,
            instance=self.index,
        )

    def _too_many_kills(self) -> bool:
        """After repeated memory kills in a window, stop restarting and say why."""
        now = self._clock.now()
        self._kills = [t for t in self._kills if now - t < self._context.kill_window_s]
        self._kills.append(now)
        if len(self._kills) < self._context.max_kills:
            return False
        self._fail(
            f"killed {len(self._kills)} times within {self._context.kill_window_s:.0f} s for "
            f"using more than its memory limit ({self.reason}); not restarted. Hint: raise "
            f"memory_mb in model.toml or fix the model, then infergate model load "
            f"{self.spec.model}"
        )
        self._context.events.publish(
            "model_load_failed", self.spec.model, self.reason or "", self.spec.version
        )
        return True

    def _said(self, exc: Exception) -> str:
        """A worker's error as its user reads it: the runtime names the file it opened,
        the gateway's verified copy; the user knows their file in the repository."""
        text = str(exc)
        if self.spec.source is not None:
            text = text.replace(str(self.spec.path), str(self.spec.source))
        return text

    def _fail(self, reason: str) -> None:
        self.state, self.reason = "failed", reason
        self._settled.set()
        self.on_failed()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop the worker: it finishes its call in flight, if any, within `grace_s`."""
        self._stopping = True
        if self.handle is not None:
            await self.handle.stop(grace_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.state != "failed":
            self.state = "stopped"
        self._settled.set()


def with_hint(said: str, over_memory: bool = False) -> str:
    """A load failure ends with what to do, unless the message already says: a worker
    killed over its memory limit while loading needs a larger one; otherwise the runtime
    could not open the file (or crashed on it)."""
    if "Hint:" in said:
        return said
    if over_memory:
        return f"{said.rstrip(' .')}. Hint: raise memory_mb in model.toml"
    return f"{said.rstrip(' .')}. Hint: fix or replace the file"
