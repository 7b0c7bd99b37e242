"""Read models: frozen snapshots of what the engine serves, for everyone who only looks.

The HTTP views, the admin API, the dashboard's stats and the memory monitor read these
instead of walking
registry → served versions → instances → placement themselves, so the engine's live
objects can change shape without breaking them, and a reader never sees an object
change under it. A snapshot is taken when asked (`Engine.snapshot`, `Engine.model_view`):
cheap next to the JSON built from it, and never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from infergate.engine.admission.breaker import BreakerPolicy
from infergate.engine.admission.tenants import Tenant, TenantState
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.lifecycle.registry import ModelRecord
from infergate.engine.lifecycle.served import ServedVersion
from infergate.engine.repository.sequence_config import SequenceSettings, client_tensors
from infergate.engine.repository.spec import TensorSpec, VersionPolicy


@dataclass(frozen=True)
class InstanceView:
    index: int
    state: str
    ready: bool
    pid: int | None
    restarts: int
    batches: int
    reason: str | None
    device: str | None  # what the worker's runtime reports it runs on
    placed_on: str | None  # where placement put it: "cpu", "cuda:1", "sim:0"
    memory_limit_mb: int | None
    threads: int | None
    cpus: tuple[int, ...] | None
    visible_devices: str | None


@dataclass(frozen=True)
class BreakerView:
    model: str
    version: int
    state: str
    reason: str
    retry_after_s: float
    window_requests: int
    window_failures: int
    window_p99_s: float | None  # None: no latency measured in the window
    policy: BreakerPolicy
    # Tenants refused on their own (their requests alone failed it), with the seconds left.
    cut_off: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionView:
    name: str
    version: int
    state: str
    ready: bool
    reason: str | None
    path: str
    sha256: str
    platform: str
    in_flight: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instances: tuple[InstanceView, ...]
    breaker: BreakerView
    queue: dict[str, int]  # waiting requests by priority class
    version_policy: VersionPolicy
    max_batch_size: int  # rows the scheduler merges into one batch; 0: it does not batch
    max_queue_delay_s: float  # how long a part-full batch may wait to fill
    upstream: dict[str, Any] | None = None  # a remote model's endpoints, as they are now
    sequence: SequenceSettings | None = None  # the gateway's own sequence tensors, if any

    @property
    def client_inputs(self) -> list[TensorSpec]:
        """The inputs a client sends: the gateway's sequence tensors left out."""
        return client_tensors(self.inputs, self.sequence)

    @property
    def client_outputs(self) -> list[TensorSpec]:
        return client_tensors(self.outputs, self.sequence)


@dataclass(frozen=True)
class ModelView:
    name: str
    state: str
    reason: str | None
    default_version: int | None
    versions: tuple[VersionView, ...]  # by version number
    failures: dict[int, str]  # version -> why it did not load


@dataclass(frozen=True)
class WorkerView:
    """A live worker with a memory limit, loading or serving: what the monitor watches.
    Its own (memory_mb in model.toml), or, with none, its tenant's quota: then `tenant`
    names the tenant and `memory_limit_mb` is 0."""

    model: str
    version: int
    instance: int
    pid: int
    memory_limit_mb: int
    tenant: str | None = None
    tenant_left_mb: float = 0.0  # the tenant's quota less what its models reserve
    loading: bool = False  # of a version not serving yet (a reload's new one, say)
    ready_mb: float | None = None  # what it used when it became ready (None: unknown)


def worker_views(
    instances: Iterable[Instance],
    left: Callable[[str], float | None] = lambda _: None,
    loading: Collection[int] = (),
) -> list[WorkerView]:
    """The workers among `instances` that are alive and have a memory limit: their own,
    or what is `left` of their tenant's quota (None: the tenant's use is not held to it).
    `loading`: the ids of the instances of versions not serving yet."""
    out = []
    for instance in instances:
        limit = instance.placement.memory_mb if instance.placement else None
        pid = instance.pid
        if pid is None:
            continue
        spec = instance.spec
        if limit:
            out.append(WorkerView(spec.model, spec.version, instance.index, pid, limit))
        elif isinstance(instance.tenant, str) and (room := left(instance.tenant)) is not None:
            serving = id(instance) not in loading
            view = WorkerView(
                spec.model,
                spec.version,
                instance.index,
                pid,
                0,
                instance.tenant,
                room,
                not serving,
                instance.ready_mb,
            )
            out.append(view)
    return out


def instance_view(instance: Instance, never_started: str | None = None) -> InstanceView:
    """`never_started`: the version's state when it starts no instance (unavailable: its
    runtime is missing; failed: refused), which its instances show rather than the
    "loading" they were made with."""
    placement, ready = instance.placement, instance.ready_info
    return InstanceView(
        index=instance.index,
        state=never_started or instance.state,
        ready=instance.ready,
        pid=instance.pid,
        restarts=instance.restarts,
        batches=instance.batches,
        reason=instance.reason,
        device=ready.device if ready else None,
        placed_on=placement.device if placement else None,
        memory_limit_mb=placement.memory_mb if placement else None,
        threads=placement.threads if placement else None,
        cpus=placement.cpus if placement and placement.cpus else None,
        visible_devices=ready.visible_devices if ready else None,
    )


def breaker_view(served: ServedVersion) -> BreakerView:
    b = served.breaker
    total, failed, p99 = b.window_stats()
    return BreakerView(
        model=served.name,
        version=served.version,
        state=b.state,
        reason=b.reason,
        retry_after_s=b.retry_after(),
        window_requests=total,
        window_failures=failed,
        window_p99_s=p99,
        policy=b.policy,
        cut_off={str(t): left for t, left in b.cut_off_tenants().items()},
    )


def _never_started(served: ServedVersion) -> str | None:
    if served.unavailable is not None:
        return "unavailable"
    return "failed" if served.refused is not None else None


def version_view(served: ServedVersion) -> VersionView:
    policy = served.scheduler.policy
    return VersionView(
        name=served.name,
        version=served.version,
        state=served.state,
        ready=served.ready,
        reason=served.reason,
        path=str(served.file.path),
        sha256=served.sha256,
        platform=served.platform,
        in_flight=served.in_flight,
        inputs=served.inputs,
        outputs=served.outputs,
        instances=tuple(instance_view(i, _never_started(served)) for i in served.instances),
        breaker=breaker_view(served),
        queue=served.depth_by_class(),
        version_policy=served.config.version_policy,
        max_batch_size=policy.max_batch_size if served.batchable else 0,
        max_queue_delay_s=policy.max_delay_s,
        upstream=served.upstream_status(),
        sequence=served.config.sequence,
    )


def model_view(record: ModelRecord) -> ModelView:
    default = record.default_version()
    return ModelView(
        name=record.name,
        state=record.state,
        reason=record.reason,
        default_version=default.version if default else None,
        versions=tuple(version_view(record.versions[v]) for v in sorted(record.versions)),
        failures=dict(sorted(record.failures.items())),
    )


@dataclass(frozen=True)
class TenantView:
    tenant: Tenant  # its settings, as the profile gives them
    tokens: float  # left in its rate bucket now
    in_flight: int
    admitted: int
    rate_limited: int
    over_concurrency: int
    forbidden: int
    reserved_mb: float  # memory its models' instances hold against its quota


def tenant_view(state: TenantState, reserved_mb: float) -> TenantView:
    return TenantView(
        tenant=state.tenant,
        tokens=state.bucket.tokens,
        in_flight=state.concurrency.active,
        admitted=state.admitted,
        rate_limited=state.rate_limited,
        over_concurrency=state.over_concurrency,
        forbidden=state.forbidden,
        reserved_mb=reserved_mb,
    )
