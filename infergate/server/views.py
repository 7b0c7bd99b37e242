"""Engine records as the JSON documents the API returns."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any, NamedTuple

from infergate.engine.admission.tenants import NO_CONCURRENCY_LIMIT, NO_RATE_LIMIT
from infergate.engine.engine import Engine
from infergate.engine.placement.devices import DeviceBackend, DeviceUsage, ProcessUsage
from infergate.engine.snapshots import BreakerView, InstanceView, ModelView, VersionView


def limit(value: float) -> float | None:
    """A tenant limit as JSON: null where the profile sets none (limits are opt-in)."""
    return None if value in (NO_RATE_LIMIT, NO_CONCURRENCY_LIMIT) else value


def model_metadata(version: VersionView, model: ModelView) -> dict[str, Any]:
    return {
        "name": version.name,
        "versions": [str(v.version) for v in model.versions],
        "platform": version.platform,
        "inputs": [s.to_json() for s in version.client_inputs],
        "outputs": [s.to_json() for s in version.client_outputs],
        "parameters": {"sha256": version.sha256, "state": version.state},
    }


def instance_json(i: InstanceView) -> dict[str, Any]:
    return {
        "index": i.index,
        "state": i.state,
        "pid": i.pid,
        "restarts": i.restarts,
        "batches": i.batches,
        "device": i.device,
        "placed_on": i.placed_on,
        "memory_limit_mb": i.memory_limit_mb,
        "threads": i.threads,
        "cpus": list(i.cpus) if i.cpus else None,
        "visible_devices": i.visible_devices,
        "reason": i.reason,
    }


def version_status(v: VersionView) -> dict[str, Any]:
    status = _version_status(v)
    if v.upstream is not None:  # a remote model: where it runs, and how each endpoint is
        status["remote"] = v.upstream
    return status


def _version_status(v: VersionView) -> dict[str, Any]:
    return {
        "version": v.version,
        "state": v.state,
        "reason": v.reason,
        "path": v.path,
        "sha256": v.sha256,
        "platform": v.platform,
        "in_flight": v.in_flight,
        "instances": [instance_json(i) for i in v.instances],
        "inputs": [s.to_json() for s in v.inputs],
        "outputs": [s.to_json() for s in v.outputs],
    }


def model_status(model: ModelView) -> dict[str, Any]:
    return {
        "name": model.name,
        "state": model.state,
        "reason": model.reason,
        "default_version": model.default_version,
        "versions": [version_status(v) for v in model.versions],
        "failures": {str(v): why for v, why in model.failures.items()},
    }


def breaker_json(b: BreakerView, fields: list[str]) -> dict[str, Any]:
    return {
        "model": b.model,
        "version": b.version,
        "state": b.state,
        # Absent values are null, never a stand-in such as "" or 0 (README, CLI section).
        "reason": b.reason or None,
        "retry_after_s": round(b.retry_after_s, 2) if b.state == "open" else None,
        "window_requests": b.window_requests,
        "window_failures": b.window_failures,
        "window_p99_ms": None if b.window_p99_s is None else round(b.window_p99_s * 1000, 1),
        "policy": {k: getattr(b.policy, k) for k in fields},
        # tenant: seconds left, for those cut off on their own (their requests alone failed)
        "tenants_cut_off": {t: round(left, 2) for t, left in b.cut_off.items()},
    }


def repository_index(models: list[ModelView]) -> list[dict[str, Any]]:
    """Triton's index: a row per model version, with state and reason."""
    rows: list[dict[str, Any]] = []
    for record in models:
        served_versions = {v.version for v in record.versions}
        for served in record.versions:
            # Triton's words only (READY, LOADING, UNAVAILABLE): clients switch on them.
            # Ours that Triton lacks (restarting, failed, stopped) are UNAVAILABLE, named
            # in the reason.
            if served.ready:
                state, reason = "READY", served.reason or ""
            elif served.state == "loading":
                state, reason = "LOADING", served.reason or ""
            else:
                state = "UNAVAILABLE"
                reason = f"{served.state}: {served.reason}" if served.reason else served.state
            rows.append(
                {
                    "name": record.name,
                    "version": str(served.version),
                    "state": state,
                    "reason": reason,
                }
            )
        for version, why in record.failures.items():
            if version not in served_versions:
                rows.append(
                    {
                        "name": record.name,
                        "version": str(version),
                        "state": "UNAVAILABLE",
                        "reason": why,
                    }
                )
        if not record.versions and not record.failures:
            state = "LOADING" if record.state == "loading" else "UNAVAILABLE"
            rows.append({"name": record.name, "state": state, "reason": record.reason or ""})
    return rows


class DeviceSample(NamedTuple):
    """Devices and workers' processes as sampled for one scrape or stats document."""

    devices: list[DeviceUsage]
    usage: dict[int, ProcessUsage | None]  # by worker pid


def _sample(backend: DeviceBackend, pids: list[int]) -> DeviceSample:
    return DeviceSample(backend.devices(), {pid: backend.process(pid) for pid in pids})


async def device_sample(engine: Engine) -> DeviceSample:
    """Sample the devices and the workers' processes in a thread: psutil and NVML read
    /proc and the driver, and the event loop waits for neither."""
    pids = [i.pid for m in engine.model_views() for v in m.versions for i in v.instances if i.pid]
    return await asyncio.to_thread(_sample, engine.context.devices, pids)


def stats_snapshot(engine: Engine, sample: DeviceSample) -> dict[str, Any]:
    """Everything the dashboard shows, in one document (GET /admin/stats)."""
    context = engine.context
    models, workers = [], []
    for model in engine.model_views():
        default = next((v for v in model.versions if v.version == model.default_version), None)
        instances = [i for v in model.versions for i in v.instances]
        for version in model.versions:
            for i in version.instances:
                usage = sample.usage.get(i.pid) if i.pid else None
                workers.append(
                    {
                        "model": version.name,
                        "version": version.version,
                        "instance": i.index,
                        "pid": i.pid,
                        "state": i.state,
                        "restarts": i.restarts,
                        "device": i.placed_on,
                        "memory_mb": round(usage.memory_mb, 1) if usage else None,
                        "memory_limit_mb": i.memory_limit_mb,
                        "cpu_percent": usage.cpu_percent if usage else None,
                    }
                )
        models.append(
            {
                "name": model.name,
                "state": model.state,
                "reason": model.reason,
                "default_version": model.default_version,
                "versions": [v.version for v in model.versions],
                "instances_ready": sum(1 for i in instances if i.ready),
                "instances": len(instances),
                "breaker": default.breaker.state if default else None,
                "queue": default.queue if default else {},
                **context.stats.model(model.name),
            }
        )
    tenants = [
        {
            "name": s.tenant.name,
            "class": s.tenant.cls,
            "rps_limit": limit(s.tenant.rps),
            "rps": context.stats.tenant_rps(s.tenant.name),
            "reserved_mb": s.reserved_mb,
            "in_flight": s.in_flight,
            "max_concurrency": limit(s.tenant.max_concurrency),
            "admitted": s.admitted,
            "rejected": s.rate_limited + s.over_concurrency + s.forbidden,
            "memory_mb": s.tenant.memory_mb,
        }
        for s in engine.tenant_views()
    ]
    return {
        "backend": context.devices.name,
        "devices": [asdict(d) for d in sample.devices],
        "workers": workers,
        "models": models,
        "tenants": tenants,
        "throughput": context.stats.history(120),
        "events": [e.to_json() for e in context.events.recent()[-30:]],
    }


def refresh_gauges(engine: Engine, sample: DeviceSample) -> None:
    """Point-in-time gauges, set just before a scrape: queues, devices, workers."""
    context = engine.context
    metrics = context.metrics
    metrics.queue_depth.clear()
    metrics.worker_memory.clear()
    for model in engine.model_views():
        for version in model.versions:
            for cls, depth in version.queue.items():
                metrics.queue_depth.labels(version.name, cls).set(depth)
            for i in version.instances:
                usage = sample.usage.get(i.pid) if i.pid else None
                if usage is not None:
                    metrics.worker_memory.labels(
                        version.name, str(version.version), str(i.index)
                    ).set(usage.memory_mb * 2**20)
    for device in sample.devices:
        metrics.device_utilization.labels(device.name).set(device.utilization)
        metrics.device_memory.labels(device.name).set(device.memory_used_mb * 2**20)
