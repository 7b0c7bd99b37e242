"""The engine façade the HTTP layer calls: what is served, inference on it, and the
repository's load and unload."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

from infergate.engine.admission.breaker import Admission
from infergate.engine.admission.tenants import TenantState
from infergate.engine.context import EngineContext
from infergate.engine.inference import InferenceRequest, InferenceResult
from infergate.engine.lifecycle.registry import ModelRecord, Registry
from infergate.engine.lifecycle.served import ServedVersion
from infergate.engine.placement.monitor import MemoryMonitor
from infergate.engine.repository.watcher import RepositoryWatcher
from infergate.engine.scheduling.sequence_step import infer_in_sequence
from infergate.engine.settings import LiveSettings
from infergate.engine.snapshots import (
    ModelView,
    TenantView,
    VersionView,
    WorkerView,
    model_view,
    tenant_view,
    version_view,
    worker_views,
)
from infergate.engine.workers import starting
from infergate.errors import (
    Forbidden,
    InfergateError,
    ModelFailed,
    ModelNotFound,
    ModelNotReady,
    RateLimited,
)
from infergate.tensors import Array

if TYPE_CHECKING:  # redis is imported only by a gateway with [cluster] (gateway.py)
    from infergate.engine.cluster.redis_limits import Ticket

ModelControl = Literal["poll", "explicit"]


@dataclass(frozen=True)
class EngineSettings:
    models_dir: Path
    model_control: ModelControl = "poll"
    stable_s: float = 1.0  # a changed file is acted on once unchanged this long


class Engine:
    def __init__(self, settings: EngineSettings, context: EngineContext | None = None) -> None:
        self.settings = settings
        self.context = context or EngineContext()
        self.registry = Registry(settings.models_dir, self.context)
        self._loaded = asyncio.Event()
        self._watcher: RepositoryWatcher | None = None
        self._monitor = MemoryMonitor(self.worker_views, self.kill_over_memory, self.context)
        self._startup: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start loading every model and, in poll mode, watching; returns at once."""
        self._startup = asyncio.create_task(self._load_all(), name="engine:initial-load")
        self._monitor.start()
        if self.context.shared_limits is not None:
            await self.context.shared_limits.start()

    async def _load_all(self) -> None:
        if self.settings.model_control == "poll":
            # Watch before the first scan, so nothing written during it is missed.
            self._watcher = RepositoryWatcher(
                self.settings.models_dir, self.registry, self.context, self.settings.stable_s
            )
            self._watcher.start()
        await self.registry.sync_all()
        self._loaded.set()

    @property
    def ready(self) -> bool:
        return self._loaded.is_set()

    async def stop(self) -> None:
        if self.context.shared_limits is not None:
            await self.context.shared_limits.stop()  # leases cut off by a drain
        await self._monitor.stop()
        if self._watcher is not None:
            await self._watcher.stop()
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        await self.registry.stop()
        await starting.stop()  # after the workers: reaped here, not orphaned

    def model(self, name: str) -> ModelRecord:
        return self.registry.record(name)

    def model_views(self) -> list[ModelView]:
        """What is served, as frozen snapshots for readers (engine/snapshots.py)."""
        return [model_view(r) for r in self.registry.records()]

    def model_view(self, name: str) -> ModelView:
        return model_view(self.registry.record(name))

    def version_view(self, name: str, version: int | None = None) -> VersionView:
        """The version a request for `name` (and `version`) would reach, as a snapshot."""
        return version_view(self.version(name, version))

    def statistics(
        self, name: str | None = None, version: int | None = None
    ) -> list[dict[str, Any]]:
        """Triton's per-version statistics documents, copied now: every version served,
        the versions of `name`, or that one `version` of it (404s as `version` raises)."""
        if name is None:
            chosen = [r.versions[v] for r in self.registry.records() for v in sorted(r.versions)]
        elif version is not None:
            chosen = [self.version(name, version)]
        else:
            record = self.registry.record(name)
            chosen = [record.versions[v] for v in sorted(record.versions)]
        return [s.scheduler.stats.to_json(s.name, s.version) for s in chosen]

    def reset_breakers(self, name: str) -> None:
        """Close the breakers of every version of `name` (a command: admin's reset)."""
        for served in self.registry.record(name).versions.values():
            served.breaker.reset()

    def worker_views(self) -> list[WorkerView]:
        """Live workers with a memory limit, of loading versions too (the monitor's)."""
        return worker_views(
            self.registry.instances(), self._quota_left, self.registry.loading_instances()
        )

    def _quota_left(self, tenant: str) -> float | None:
        """What is left of `tenant`'s memory quota beside its reservations, when the
        profile holds its use to it (memory_mb set); else None."""
        try:
            quota = self.context.tenants.get(tenant).tenant
        except KeyError:
            return None
        if not quota.memory_enforced:
            return None
        return max(0.0, quota.memory_mb - self.context.placer.reserved(tenant=tenant))

    def kill_over_memory(self, worker: WorkerView, used_mb: float, tenant_mb: float = 0.0) -> None:
        """A command, not a read: kill `worker` for its memory, if it still runs
        (`tenant_mb`: what its tenant's workers without a limit of their own use)."""
        self.registry.kill_over_memory(worker, used_mb, tenant_mb)

    def tenant_views(self) -> list[TenantView]:
        placer = self.context.placer
        return [
            tenant_view(s, placer.reserved(tenant=s.tenant.name))
            for s in self.context.tenants.states()
        ]

    def tenant_view(self, name: str) -> TenantView:
        """KeyError for a tenant the profile does not define."""
        state = self.context.tenants.get(name)
        return tenant_view(state, self.context.placer.reserved(tenant=name))

    def version(
        self,
        name: str,
        version: int | None = None,
        visible: Callable[[str], bool] | None = None,
    ) -> ServedVersion:
        """The version a request for `name` reaches; a 404 names only `visible` models."""
        record = self.registry.record(name, visible)
        if version is None:
            served = record.default_version()
            if served is None:
                raise _no_version_error(record)
            return served
        try:
            return record.versions[version]
        except KeyError:
            live = ", ".join(str(v) for v in sorted(record.versions)) or "none"
            raise ModelNotFound(
                f"model {name!r} has no version {version} being served; live versions: {live}. "
                "Hint: model.toml's [version_policy] says which versions serve (by default "
                "the highest only; all = true, or versions = [...], serves others)"
            ) from None

    def apply_settings(self, settings: LiveSettings) -> None:
        """A new profile while serving: tenants, classes and breakers change at once;
        batching defaults apply to versions loaded from now on."""
        self.context.settings = settings  # the swap: one assignment
        self.context.tenants.configure(
            list(settings.tenants), settings.admin_keys, settings.allow_anonymous
        )
        for record in self.registry.records():
            for served in record.versions.values():
                served.breaker.reconfigure(settings.breaker_policy(served.name, served.config))

    async def load(self, name: str, override: dict[str, Any] | None = None) -> str | None:
        """Load (or reload) `name` from disk, as Triton's repository API does, with
        `override` (a checked `parameters.config`; None: the files alone): None once it
        serves, else why not (the override that serves stays). ModelNotFound for none."""
        return await self.registry.load(name, override)

    async def unload(self, name: str) -> None:
        await self.registry.unload(name)

    async def infer(
        self, request: InferenceRequest, tenant: TenantState | None = None
    ) -> InferenceResult:
        """Admit (tenant limits), validate, pass the breaker, schedule, and record."""
        state = tenant or self.context.tenants.authenticate(None)
        self.admit(state, request.model)
        try:
            return await self.infer_admitted(request, state)
        finally:
            self.leave(state)

    def check_allowed(self, state: TenantState, model: str) -> None:
        """403 for a model outside the tenant's allow-list, counted as `admit` counts it.
        Asked before anything about the model is looked up, so that a tenant learns
        nothing of a model it may not use: whether it exists, or why it is not ready."""
        try:
            self.context.tenants.check_allowed(state, model)
        except Forbidden as exc:
            self.context.metrics.rate_limited.labels(state.tenant.name, exc.reason).inc()
            raise

    def admit(self, state: TenantState, model: str) -> None:
        """The one admission check (allow-list, rate, concurrency); on success the caller
        must `leave`. The HTTP route calls it before reading the body, so a refused
        request costs no upload and no decoding."""
        tenants = self.context.tenants
        try:
            tenants.admit(state, model)
        except (RateLimited, Forbidden) as exc:
            self.context.metrics.rate_limited.labels(state.tenant.name, exc.reason).inc()
            raise

    def leave(self, state: TenantState) -> None:
        self.context.tenants.leave(state)

    async def admit_shared(self, state: TenantState, model: str) -> Ticket:
        """`admit` against the limits every replica shares ([cluster]); on success the
        caller must `leave_shared`. Only for an engine whose context has shared_limits."""
        shared = self.context.shared_limits
        assert shared is not None
        try:
            return await shared.admit(state, model)
        except (RateLimited, Forbidden) as exc:
            self.context.metrics.rate_limited.labels(state.tenant.name, exc.reason).inc()
            raise

    async def leave_shared(self, ticket: Ticket) -> None:
        assert self.context.shared_limits is not None
        await self.context.shared_limits.release(ticket)

    def infer_admitted(
        self, request: InferenceRequest, tenant: TenantState
    ) -> Coroutine[Any, Any, InferenceResult]:
        """`infer` for a caller that already holds an admission from `admit`: the
        coroutine to await (`begin_admitted`, then `finish` with what it awaited). A plain
        function, not a coroutine of its own: every await level is paid again at each
        suspension and resumption of a request's task."""
        return self._awaited(self.begin_admitted(request, tenant))

    def begin_admitted(
        self,
        request: InferenceRequest,
        tenant: TenantState,
        served: ServedVersion | None = None,
    ) -> InferenceResult | Running:
        """`infer_admitted` without awaiting, for a caller that cannot await (the infer
        lane, server/infer_lane.py): the result at once (a batch of zero rows), or the
        request queued; `finish` gives its result from what `Running.waiting` gave. A
        refusal (404, 503, the breaker, a full queue) is raised here. `served`: the version
        the request names, when the caller has looked it up already."""
        if served is None:
            served = self.version(request.model, request.version, tenant.tenant.may_use)
        if request.sequence is not None or served.sequences is not None:
            run = partial(self._run, served, tenant=tenant)
            return Running(infer_in_sequence(served, request, run, tenant.tenant.name))
        return self._start_run(served, request, tenant)

    def finish(self, running: Running, outcome: Any) -> InferenceResult:
        """The result of a request `begin_admitted` queued, from what its `waiting`
        returned (`outcome`), counted."""
        served = running.served
        if served is None:  # a sequence's step: its coroutine gave the result itself
            return cast(InferenceResult, outcome)
        served.end(running.started, outcome, None)
        result, timing = outcome
        # Its execution time (the longest batch it ran in), not its queue wait: other
        # tenants' traffic is not the model's doing, nor is the size of a chunked request.
        # A batch several tenants shared counts for them together (breaker.py). A normal
        # request that ran in one piece its batch counted (`Timing.counted`).
        if not timing.counted:
            served.breaker.record(
                running.admission, True, timing.slowest_s, running.tenant, timing.shared
            )
        return InferenceResult(served.name, served.version, result)

    def fail(self, running: Running, error: BaseException) -> None:
        """Count a request `begin_admitted` queued whose `waiting` raised `error` (its
        caller raises or answers it: not raised here, where its traceback would hold
        this frame and the request's tensors in a reference cycle)."""
        served = running.served
        if served is None:  # a sequence's step counted itself
            return
        served.end(running.started, None, error)
        if isinstance(error, Exception):
            served.breaker_failed(running.admission, error, running.tenant)
        else:  # cancelled: nothing to judge, and a probe's place is given back
            served.breaker.unjudged(running.admission)

    async def _awaited(self, running: InferenceResult | Running) -> InferenceResult:
        if isinstance(running, InferenceResult):
            return running
        try:
            outcome = await running.waiting
        except BaseException as exc:
            self.fail(running, exc)
            raise
        return self.finish(running, outcome)

    async def _run(
        self, served: ServedVersion, request: InferenceRequest, tenant: TenantState
    ) -> InferenceResult:
        return await self._awaited(self._start_run(served, request, tenant))

    def _start_run(
        self, served: ServedVersion, request: InferenceRequest, tenant: TenantState
    ) -> InferenceResult | Running:
        if not served.ready:
            raise served.not_ready_error()
        key = served.check_inputs(request.inputs)
        outputs = served.check_outputs(request.outputs)
        classes = self.context.settings.classes
        cls = classes.resolve(request.priority, cap=classes.get(tenant.tenant.cls))
        if is_empty_batch(request.inputs):
            # Nothing to run: answered here, without the worker, the queue or the breaker.
            return InferenceResult(served.name, served.version, served.empty_outputs(outputs))
        # The client's timeout bounds its wait in the queue, as in Triton; once it runs,
        # only the model's own timeout_ms bounds it (a client cannot kill a worker).
        queue_deadline = cls.deadline_s
        if request.timeout_s is not None:
            queue_deadline = min(queue_deadline, request.timeout_s)
        who = tenant.tenant.name  # the breaker cuts off one tenant that alone fails it
        admission = served.breaker.allow(who)
        if admission == "refused":
            raise served.circuit_open(who)
        try:
            waiting, started = served.begin(
                request.inputs,
                key,
                outputs,
                cls,
                queue_deadline,
                served.config.timeout_s,
                request.session,
                tenant.tenant.fairness,
                request.instance,
                admission == "normal",
            )
        except Exception as exc:
            served.breaker_failed(admission, exc, who)
            raise
        return Running(waiting, served, admission, started, who)


class Running(NamedTuple):
    """A request `Engine.begin_admitted` queued: what to await, and what `Engine.finish` needs."""

    waiting: Awaitable[Any]
    served: ServedVersion | None = None  # None: `waiting` gives the InferenceResult itself
    admission: Admission = "normal"
    started: float = 0.0
    tenant: str | None = None  # whose request, for the breaker


def is_empty_batch(inputs: dict[str, Array]) -> bool:
    """A batch of zero rows (tritonclient sends np.zeros((0, n)) as shape [0, n])."""
    first = next(iter(inputs.values()), None)
    if first is None or first.shape[:1] != (0,):  # the usual case, decided at once
        return False
    return all(a.shape[:1] == (0,) for a in inputs.values())


def _no_version_error(record: ModelRecord) -> InfergateError:
    """Why a model has nothing to serve, as the status a client should act on: 503 with
    Retry-After only while it is on its way; otherwise no retry will help."""
    name, state = record.name, record.state
    if state == "loading":  # (no reason yet: "no version on disk" named a model loading one)
        said = f": {record.reason}" if record.reason else ""
        return ModelNotReady(f"model {name!r} is loading{said}. Hint: retry shortly")
    why = record.reason or "no version on disk"
    if state == "unloaded":
        return ModelNotFound(
            f"Request for unknown model: {name!r} is not found: it was unloaded. "
            f"Hint: infergate model load {name}"
        )
    if "Hint:" in why:  # its own (install X, then model load NAME): one hint, not two
        return ModelFailed(f"model {name!r} failed to load: {why}")
    return ModelFailed(
        f"model {name!r} failed to load: {why}. Hint: fix it and reload it (infergate model "
        f"status {name} shows why, infergate model load {name} retries)"
    )
