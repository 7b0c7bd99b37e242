"""Engine records as the JSON documents the API returns."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from infergate.engine.engine import Engine
from infergate.engine.registry import ModelRecord
from infergate.engine.remote.served import RemoteServedVersion
from infergate.engine.served import ServedVersion
from infergate.engine.tenants import NO_CONCURRENCY_LIMIT, NO_RATE_LIMIT


def limit(value: float) -> float | None:
    """A tenant limit as JSON: null where the profile sets none (limits are opt-in)."""
    return None if value in (NO_RATE_LIMIT, NO_CONCURRENCY_LIMIT) else value


def model_metadata(served: ServedVersion, record: ModelRecord) -> dict[str, Any]:
    return {
        "name": served.name,
        "versions": [str(v) for v in sorted(record.versions)],
        "platform": served.platform,
        "inputs": [s.to_json() for s in served.inputs],
        "outputs": [s.to_json() for s in served.outputs],
        "parameters": {"sha256": served.sha256, "state": served.state},
    }


def version_status(served: ServedVersion) -> dict[str, Any]:
    status = _version_status(served)
    if isinstance(served, RemoteServedVersion):  # where it runs, and how each endpoint is
        status["remote"] = {"model": served.model_path, "endpoints": served.endpoints_status()}
    return status


def _version_status(served: ServedVersion) -> dict[str, Any]:
    return {
        "version": served.version,
        "state": served.state,
        "reason": served.reason,
        "path": str(served.file.path),
        "sha256": served.sha256,
        "platform": served.platform,
        "in_flight": served.in_flight,
        "instances": [
            {
                "index": i.index,
                "state": i.state,
                "pid": i.pid,
                "restarts": i.restarts,
                "batches": i.batches,
                "device": i.ready_info.device if i.ready_info else None,
                "placed_on": i.placement.device if i.placement else None,
                "memory_limit_mb": i.placement.memory_mb if i.placement else None,
                "threads": i.placement.threads if i.placement else None,
                "cpus": list(i.placement.cpus) if i.placement and i.placement.cpus else None,
                "visible_devices": i.ready_info.visible_devices if i.ready_info else None,
                "reason": i.reason,
            }
            for i in served.instances
        ],
        "inputs": [s.to_json() for s in served.inputs],
        "outputs": [s.to_json() for s in served.outputs],
    }


def model_status(record: ModelRecord) -> dict[str, Any]:
    default = record.default_version()
    return {
        "name": record.name,
        "state": record.state,
        "reason": record.reason,
        "default_version": default.version if default else None,
        "versions": [version_status(record.versions[v]) for v in sorted(record.versions)],
        "failures": {str(v): why for v, why in sorted(record.failures.items())},
    }


def repository_index(records: list[ModelRecord]) -> list[dict[str, Any]]:
    """Triton's index: a row per model version, with state and reason."""
    rows: list[dict[str, Any]] = []
    for record in records:
        for served in sorted(record.versions.values(), key=lambda v: v.version):
            state = "READY" if served.ready else served.state.upper()
            rows.append(
                {
                    "name": record.name,
                    "version": str(served.version),
                    "state": state,
                    "reason": served.reason or "",
                }
            )
        for version, why in sorted(record.failures.items()):
            if version not in record.versions:
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


def stats_snapshot(engine: Engine) -> dict[str, Any]:
    """Everything the dashboard shows, in one document (GET /admin/stats)."""
    context = engine.context
    models, workers = [], []
    for record in engine.models():
        default = record.default_version()
        instances = [i for v in record.versions.values() for i in v.instances]
        for served in record.versions.values():
            for i in served.instances:
                usage = context.devices.process(i.pid) if i.pid else None
                workers.append(
                    {
                        "model": served.name,
                        "version": served.version,
                        "instance": i.index,
                        "pid": i.pid,
                        "state": i.state,
                        "restarts": i.restarts,
                        "device": i.placement.device if i.placement else None,
                        "memory_mb": round(usage.memory_mb, 1) if usage else None,
                        "memory_limit_mb": i.placement.memory_mb if i.placement else None,
                        "cpu_percent": usage.cpu_percent if usage else None,
                    }
                )
        models.append(
            {
                "name": record.name,
                "state": record.state,
                "reason": record.reason,
                "default_version": default.version if default else None,
                "versions": sorted(record.versions),
                "instances_ready": sum(1 for i in instances if i.ready),
                "instances": len(instances),
                "breaker": default.breaker.state if default else None,
                "queue": default.depth_by_class() if default else {},
                **context.stats.model(record.name),
            }
        )
    tenants = [
        {
            "name": s.tenant.name,
            "class": s.tenant.cls,
            "rps_limit": limit(s.tenant.rps),
            "rps": context.stats.tenant_rps(s.tenant.name),
            "reserved_mb": context.placer.reserved(tenant=s.tenant.name),
            "in_flight": s.concurrency.active,
            "max_concurrency": limit(s.tenant.max_concurrency),
            "admitted": s.admitted,
            "rejected": s.rate_limited + s.over_concurrency + s.forbidden,
            "memory_mb": s.tenant.memory_mb,
        }
        for s in context.tenants.states()
    ]
    return {
        "backend": context.devices.name,
        "devices": [asdict(d) for d in context.devices.devices()],
        "workers": workers,
        "models": models,
        "tenants": tenants,
        "throughput": context.stats.history(120),
        "events": [e.to_json() for e in context.events.recent()[-30:]],
    }


def refresh_gauges(engine: Engine) -> None:
    """Point-in-time gauges, set just before a scrape: queues, devices, workers."""
    context = engine.context
    metrics = context.metrics
    metrics.queue_depth.clear()
    metrics.worker_memory.clear()
    for record in engine.models():
        for served in record.versions.values():
            for cls, depth in served.depth_by_class().items():
                metrics.queue_depth.labels(served.name, cls).set(depth)
            for i in served.instances:
                usage = context.devices.process(i.pid) if i.pid else None
                if usage is not None:
                    metrics.worker_memory.labels(
                        served.name, str(served.version), str(i.index)
                    ).set(usage.memory_mb * 2**20)
    for device in context.devices.devices():
        metrics.device_utilization.labels(device.name).set(device.utilization)
        metrics.device_memory.labels(device.name).set(device.memory_used_mb * 2**20)
