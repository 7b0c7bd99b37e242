"""A model version being served: it puts together its instances, their placement, its
breaker, its tensor checks and its scheduler, and counts its requests in flight. Each of
those concerns lives in a module of its own; this class holds them for one version."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Hashable
from dataclasses import fields
from pathlib import Path
from typing import Any

from infergate.engine.admission.breaker import Admission
from infergate.engine.context import EngineContext
from infergate.engine.lifecycle import readiness, version_breaker
from infergate.engine.lifecycle.in_flight import InFlight
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.lifecycle.reservations import Reservations
from infergate.engine.lifecycle.tensor_checks import TensorChecks
from infergate.engine.placement.placer import PlacementRefused
from infergate.engine.repository.spec import (
    BatchingOverrides,
    ModelConfig,
    ModelEntry,
    ModelVersionFile,
    TensorSpec,
)
from infergate.engine.runtimes import runtime_kind, unavailable_reason
from infergate.engine.scheduling.batching import has_batch_dimension
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import Fairness, QueuePolicy
from infergate.engine.scheduling.scheduler import Scheduler
from infergate.engine.scheduling.sequences import SequenceTable
from infergate.engine.scheduling.tickets import Answer
from infergate.engine.workers.messages import Ready, WorkerSpec
from infergate.errors import CircuitOpen, InfergateError
from infergate.tensors import Array

STOP_GRACE_S = 5.0  # a worker's time to finish a call a request still awaits
ABANDONED_GRACE_S = 0.5  # ... and one no request awaits (an idle worker exits at once)


def queue_policy(defaults: QueuePolicy, overrides: BatchingOverrides) -> QueuePolicy:
    """The profile's batching, with model.toml's [batching] on top."""
    delay = overrides.max_queue_delay_ms
    return QueuePolicy(
        max_batch_size=defaults.max_batch_size
        if overrides.max_batch_size is None
        else overrides.max_batch_size,
        max_delay_s=defaults.max_delay_s if delay is None else delay / 1000.0,
        max_queue_size=defaults.max_queue_size
        if overrides.max_queue_size is None
        else overrides.max_queue_size,
    )


class ServedVersion:
    def __init__(
        self,
        entry: ModelEntry,
        file: ModelVersionFile,
        sha256: str,
        context: EngineContext,
        stored_path: Path | None = None,
    ) -> None:
        self.name = entry.name
        self.version = file.version
        self.file = file
        self.sha256 = sha256
        self.stored_path = stored_path  # the verified copy workers load (VerifiedStore)
        self.config: ModelConfig = entry.config
        self.platform = runtime_kind(file.runtime).platform
        self.unavailable = unavailable_reason(file.runtime, entry.name)
        self.refused: str | None = None  # placement said no: the reason
        self._context = context
        self.requests = InFlight()
        spec = WorkerSpec(
            model=entry.name,
            version=file.version,
            path=stored_path or file.path,
            source=file.path,
            runtime=file.runtime,
            device=entry.config.device,
            inputs=entry.config.inputs,
            outputs=entry.config.outputs,
            threads=entry.config.threads,
            nice=context.worker_nice,
            warmup=entry.config.warmup,
        )
        tenant = entry.config.tenant
        self.instances = [Instance(spec, i, context, tenant) for i in range(entry.config.instances)]
        # This version's own reservations: released by its stop, never by another's.
        self._reservations = Reservations(entry.name, entry.config, context.placer, context.tenants)
        self.breaker = version_breaker.version_breaker(
            entry.name, file.version, entry.config, context
        )
        version_breaker.judge_worker_deaths(self.instances, self.breaker)
        self._known: Ready | None = None
        self._batchable: bool | None = None
        self._tensors = TensorChecks(self)
        self.scheduler = Scheduler(
            entry.name,
            file.version,
            self.instances,
            queue_policy(context.settings.queue_policy, entry.config.batching),
            context.clock,
            context.metrics,
            self.breaker.record_served,
        )
        self.breaker.on_unclear = self.scheduler.keep_tenants_apart
        sequence = entry.config.sequence
        self.sequences = (
            None if sequence is None else SequenceTable(entry.name, sequence, context.clock)
        )

    def same_as(self, file: ModelVersionFile, sha256: str, config: ModelConfig) -> bool:
        """Would loading `file` again give what serves now?"""
        return self.file == file and self.sha256 == sha256 and self.config == config

    def changed_settings(self, newer: ServedVersion) -> list[str]:
        """The model.toml settings that differ between this version and `newer`."""
        return [
            f.name
            for f in fields(ModelConfig)
            if getattr(self.config, f.name) != getattr(newer.config, f.name)
        ]

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self.unavailable is not None:
            return
        try:
            self._reservations.place(self.instances)
        except PlacementRefused as exc:
            self.refused = str(exc)
            return
        for instance in self.instances:
            instance.start()

    async def wait_settled(self) -> None:
        if self.unavailable is None and self.refused is None:
            await asyncio.gather(*(i.wait_settled() for i in self.instances))

    async def stop(self) -> None:
        await self.scheduler.stop()
        if self.sequences is not None:
            self.sequences.stop()
        # A call in flight gets the usual grace while a request still awaits it (an unload
        # whose drain ran out); with none left (the gateway stopping after its drain time,
        # which answered them 503), its answer has no one to go to: it is cut short.
        grace = STOP_GRACE_S if self.in_flight else ABANDONED_GRACE_S
        await asyncio.gather(*(i.stop(grace) for i in self.instances))
        self._reservations.release()

    @property
    def in_flight(self) -> int:
        return self.requests.count

    async def drain(self, timeout_s: float) -> bool:
        """Wait for in-flight requests to finish (True), or the timeout (False)."""
        return await self.requests.drain(timeout_s)

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        if self.unavailable is not None:
            return "unavailable"
        if self.refused is not None:
            return "failed"
        return readiness.summary_state(self.instances)

    @property
    def ready(self) -> bool:
        for instance in self.instances:  # noqa: SIM110  # not any(<genexpr>): every request
            if instance.ready:
                return True
        return False

    @property
    def reason(self) -> str | None:
        if self.unavailable is not None:
            return self.unavailable
        if self.refused is not None:
            return self.refused
        return readiness.first_reason(self.instances)

    def not_ready_error(self) -> InfergateError:
        """503 with Retry-After while it is on its way; 424 when only a person can fix it."""
        return readiness.not_ready_error(self.name, self.version, self.state, self.reason)

    def upstream_status(self) -> dict[str, Any] | None:
        """Where a remote model's requests go, and how each endpoint is; None here."""
        return None

    def depth_by_class(self) -> dict[str, int]:
        return self.scheduler.depth_by_class()

    # -- breaker -------------------------------------------------------------------------

    def breaker_failed(
        self, admission: Admission, exc: BaseException, tenant: str | None = None
    ) -> None:
        """A request of `tenant` that was let through raised: the breaker judges whether
        it counts."""
        version_breaker.record_failure(self.breaker, admission, exc, tenant)

    def circuit_open(self, tenant: str | None = None) -> CircuitOpen:
        """The answer while the breaker refuses `tenant`'s requests."""
        return version_breaker.circuit_open(self.name, self.version, self.breaker, tenant)

    # -- tensors -------------------------------------------------------------------------

    def _ready_info(self) -> Ready | None:
        # The tensors a version's file declares never change, so the first worker to load
        # answers for all of them, and for good (this is read on every request).
        if self._known is None:
            self._known = next((i.ready_info for i in self.instances if i.ready_info), None)
        return self._known

    @property
    def tensors_final(self) -> bool:
        return self._ready_info() is not None

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        info = self._ready_info()
        return info.inputs if info else self.config.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        info = self._ready_info()
        return info.outputs if info else self.config.outputs

    @property
    def batchable(self) -> bool:
        if self._batchable is None:
            batchable = self.scheduler.policy.max_batch_size > 1 and has_batch_dimension(
                self.inputs, self.outputs
            )
            if self._ready_info() is None:
                return batchable  # from model.toml alone: not final until a worker loads
            self._batchable = batchable
        return self._batchable

    def check_inputs(self, inputs: dict[str, Array]) -> Hashable:
        """Check `inputs` (BadRequest naming what is wrong); the key they batch under."""
        return self._tensors.check_inputs(inputs)

    def check_outputs(self, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
        """The outputs to compute for a request that asked for `wanted` (None: all)."""
        return self._tensors.check_outputs(wanted)

    def empty_outputs(self, names: tuple[str, ...]) -> dict[str, Array]:
        """The answer to a batch of zero rows, without running it."""
        return self._tensors.empty_outputs(names)

    # -- requests ------------------------------------------------------------------------

    def begin(
        self,
        inputs: dict[str, Array],
        key: Hashable,
        outputs: tuple[str, ...],
        cls: PriorityClass,
        queue_deadline_s: float,
        timeout_s: float,
        session: str | None = None,
        fair: Fairness | None = None,
        instance: int | None = None,
        counted: bool = False,
    ) -> tuple[Awaitable[Answer], float]:
        """Queue checked inputs (`key` from check_inputs; only on `instance` when given):
        what to await for the answer, and when it began. The caller hands the outcome to
        `end`, whatever it is (a refusal raised here is counted here). `counted`: a
        normal admission's, whose success its batch counts for the breaker and the
        statistics (`Ticket.counted`; the answer's `Timing.counted` says it did)."""
        self.requests.enter()
        started = self._context.clock.now()
        try:
            waiting = self.scheduler.enqueue(
                inputs,
                key,
                outputs,
                cls,
                queue_deadline_s,
                timeout_s,
                session,
                fair,
                instance,
                counted,
            )
        except BaseException as exc:
            self.end(started, None, exc)
            raise
        return waiting, started

    def end(self, started: float, answer: Answer | None, error: BaseException | None) -> None:
        """Count a request `begin` queued, answered or failed (a cancelled one is not
        counted in the statistics), and let go of its place among those in flight."""
        if error is None:
            assert answer is not None
            timing = answer[1]
            if not timing.counted:  # (else its batch counted it)
                total_s = self._context.clock.now() - started
                self.scheduler.stats.request_done(total_s, timing.queue_s, timing.compute_s)
        elif isinstance(error, InfergateError):
            self.scheduler.stats.request_failed(self._context.clock.now() - started)
        self.requests.leave()
