"""A model version being served: its instances, its state, dispatch to them, and drain."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from infergate.engine.admission.breaker import Admission, Breaker
from infergate.engine.admission.tenants import DEFAULT_TENANT, Tenant
from infergate.engine.context import EngineContext
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.placement.placer import PlacementRefused, Reservation
from infergate.engine.repository.spec import (
    BatchingOverrides,
    ModelConfig,
    ModelEntry,
    ModelVersionFile,
    TensorSpec,
)
from infergate.engine.runtimes import runtime_kind, unavailable_reason
from infergate.engine.scheduling.batching import batch_key, has_batch_dimension
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import Fairness, QueuePolicy
from infergate.engine.scheduling.scheduler import Scheduler, Timing
from infergate.engine.scheduling.sequences import SequenceTable
from infergate.engine.scheduling.validate import check_inputs, check_outputs
from infergate.engine.workers.messages import Ready, WorkerSpec
from infergate.errors import CircuitOpen, InfergateError, ModelFailed, ModelNotReady
from infergate.tensors import Array, numpy_dtype


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


BREAKER_STATES = ["closed", "half_open", "open"]  # the gauge's values: 0, 1, 2

# The order a version's state is summarised in: the best instance wins.
_STATE_RANK = ["ready", "restarting", "loading", "failed", "stopped"]


_UNCHECKED = object()
_MAX_SIGNATURES = 256  # distinct input signatures remembered per version


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
        self.unavailable = unavailable_reason(file.runtime)
        self.refused: str | None = None  # placement said no: the reason
        self._reservations: list[Reservation] = []  # this version's own: released by stop
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        spec = WorkerSpec(
            model=entry.name,
            version=file.version,
            path=stored_path or file.path,
            runtime=file.runtime,
            device=entry.config.device,
            inputs=entry.config.inputs,
            outputs=entry.config.outputs,
            threads=entry.config.threads,
            nice=context.worker_nice,
            warmup=entry.config.warmup,
        )
        self.instances = [Instance(spec, i, context) for i in range(entry.config.instances)]
        self.breaker = Breaker(
            context.settings.breaker_policy(entry.name, entry.config),
            context.clock,
            on_change=self._breaker_changed,
        )
        self._context = context
        # Closed from the start: a scrape can tell a quiet breaker from a missing version.
        context.metrics.breaker_state.labels(self.name, str(self.version)).set(0)
        self._known: Ready | None = None
        self._batchable: bool | None = None
        # input signature (names, dtypes, shapes) -> its batch key, for inputs found valid
        self._checked: dict[tuple[object, ...], Hashable] = {}
        self._all_outputs: tuple[str, ...] | None = None
        self.scheduler = Scheduler(
            entry.name,
            file.version,
            self.instances,
            queue_policy(context.settings.queue_policy, entry.config.batching),
            context.clock,
            context.metrics,
        )
        sequence = entry.config.sequence
        self.sequences = (
            None if sequence is None else SequenceTable(entry.name, sequence, context.clock)
        )

    def _breaker_changed(self, state: str, reason: str) -> None:
        self._context.metrics.breaker_state.labels(self.name, str(self.version)).set(
            BREAKER_STATES.index(state)
        )
        self._context.events.publish(f"breaker_{state}", self.name, reason, self.version)

    def same_as(self, file: ModelVersionFile, sha256: str, config: ModelConfig) -> bool:
        """Would loading `file` again give what serves now?"""
        return self.file == file and self.sha256 == sha256 and self.config == config

    def start(self) -> None:
        if self.unavailable is not None:
            return
        try:
            self._place()
        except PlacementRefused as exc:
            self.refused = str(exc)
            return
        for instance in self.instances:
            instance.start()

    def _place(self) -> None:
        """Reserve a device for every instance, or none of them."""
        context = self._context
        try:
            tenant = context.tenants.get(self.config.tenant).tenant
        except KeyError:
            if self.config.tenant == DEFAULT_TENANT:  # a profile with named tenants only
                tenant = Tenant(DEFAULT_TENANT)
            else:
                raise PlacementRefused(
                    f"model.toml names tenant {self.config.tenant!r}, which the profile "
                    "does not define"
                ) from None
        try:
            for instance in self.instances:
                reservation = context.placer.place(
                    self.name,
                    tenant,
                    self.config.device,
                    self.config.memory_mb,
                    self.config.threads,
                )
                self._reservations.append(reservation)
                instance.place(reservation.placement)
        except PlacementRefused:
            self._release()
            raise

    def _release(self) -> None:
        for reservation in self._reservations:
            reservation.release()
        self._reservations.clear()

    async def wait_settled(self) -> None:
        if self.unavailable is None and self.refused is None:
            await asyncio.gather(*(i.wait_settled() for i in self.instances))

    async def stop(self) -> None:
        await self.scheduler.stop()
        if self.sequences is not None:
            self.sequences.stop()
        await asyncio.gather(*(i.stop() for i in self.instances))
        self._release()

    async def drain(self, timeout_s: float) -> bool:
        """Wait for in-flight requests to finish (True), or the timeout (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    @property
    def state(self) -> str:
        if self.unavailable is not None:
            return "unavailable"
        if self.refused is not None:
            return "failed"
        states = {
            i.state if i.state != "ready" or i.ready else "restarting" for i in self.instances
        }
        return min(states, key=_STATE_RANK.index)

    @property
    def ready(self) -> bool:
        for instance in self.instances:  # noqa: SIM110  # not any(<genexpr>): on every request
            if instance.ready:
                return True
        return False

    @property
    def reason(self) -> str | None:
        if self.unavailable is not None:
            return self.unavailable
        if self.refused is not None:
            return self.refused
        reasons = [i.reason for i in self.instances if i.reason]
        return reasons[0] if reasons else None

    def _ready_info(self) -> Ready | None:
        # The tensors a version's file declares never change, so the first worker to load
        # answers for all of them, and for good (this is read on every request).
        if self._known is None:
            self._known = next((i.ready_info for i in self.instances if i.ready_info), None)
        return self._known

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        info = self._ready_info()
        return info.inputs if info else self.config.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        info = self._ready_info()
        return info.outputs if info else self.config.outputs

    def breaker_failed(self, admission: Admission, exc: BaseException) -> None:
        """A request that was let through raised. The breaker judges the model: its own
        failures count; load (queue deadlines, shedding), the client's mistakes and the
        gateway's bugs do not, and a probe that did not reach the model only ends."""
        if isinstance(exc, InfergateError) and exc.model_fault:
            self.breaker.record(admission, False, None)
        elif admission == "probe":
            self.breaker.record(admission, True, None)

    def upstream_status(self) -> dict[str, Any] | None:
        """Where a remote model's requests go, and how each endpoint is; None here."""
        return None

    def not_ready_error(self) -> InfergateError:
        """503 with Retry-After while it is on its way (loading, restarting, or stopped
        while a reload replaces it); 424 without it when only a person can fix it (failed,
        or its runtime is not installed)."""
        state = self.state
        why = f": {self.reason}" if self.reason else ""
        if state in ("loading", "restarting", "stopped"):  # stopped: being replaced
            return ModelNotReady(
                f"model {self.name!r} version {self.version} is {state}{why}. Hint: retry shortly"
            )
        return ModelFailed(
            f"model {self.name!r} version {self.version} is {state}{why}. Hint: fix the model "
            f"and reload it (infergate model status {self.name} shows why, infergate model "
            f"load {self.name} retries)"
        )

    def circuit_open(self) -> CircuitOpen:
        """The answer while the breaker refuses requests."""
        wait = self.breaker.retry_after()
        return CircuitOpen(
            f"model {self.name!r} version {self.version} is cut off by its circuit "
            f"breaker ({self.breaker.reason}); retry in {wait:.1f} s. Hint: infergate "
            f"breaker list shows it, infergate breaker reset {self.name} closes it",
            wait,
        )

    def depth_by_class(self) -> dict[str, int]:
        return self.scheduler.depth_by_class()

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
        """Check `inputs` against this version's tensors (BadRequest naming what is wrong)
        and return the key they batch under (None: they run alone). Both depend only on
        the inputs' names, datatypes and shapes, and a service sends few of those, so the
        answer is kept per signature once the worker has said what the tensors are."""
        signature = tuple([(name, a.dtype, a.shape) for name, a in inputs.items()])
        key = self._checked.get(signature, _UNCHECKED)
        if key is _UNCHECKED:
            check_inputs(self.name, self.inputs, inputs)
            key = batch_key(inputs) if self.batchable else None
            if self._ready_info() is not None:
                if len(self._checked) >= _MAX_SIGNATURES:
                    self._checked.clear()
                self._checked[signature] = key
        return key

    def check_outputs(self, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
        """The outputs to compute for a request that asked for `wanted` (None or none
        named: all, as in Triton)."""
        if not wanted:
            wanted = None
        if wanted is None and self._all_outputs is not None:
            return self._all_outputs
        names = check_outputs(self.name, self.outputs, wanted)
        if wanted is None and self._ready_info() is not None:
            self._all_outputs = names
        return names

    def empty_outputs(self, names: tuple[str, ...]) -> dict[str, Array]:
        """The answer to a batch of zero rows, without running it: each output with zero
        rows, its other dimensions as declared (a free one is 0 too, as nothing fills it)."""
        specs = {s.name: s for s in self.outputs}
        return {
            n: np.zeros(
                (0, *(max(d, 0) for d in specs[n].shape[1:])), numpy_dtype(specs[n].datatype)
            )
            for n in names
        }

    async def infer(
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
    ) -> tuple[dict[str, Array], Timing]:
        """Run checked inputs (`key` from check_inputs); only on `instance` when given."""
        # Counted from the same loop step that chose this version, so a drain never
        # misses a request that is about to start.
        self.in_flight += 1
        self._idle.clear()
        clock, stats = self._context.clock, self.scheduler.stats
        started = clock.now()
        try:
            result = await self.scheduler.submit(
                inputs, key, outputs, cls, queue_deadline_s, timeout_s, session, fair, instance
            )
        except InfergateError:
            stats.request_failed(clock.now() - started)
            raise
        else:
            stats.request_done(clock.now() - started, result[1].queue_s, result[1].compute_s)
            return result
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
