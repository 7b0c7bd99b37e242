"""Engine records as the JSON documents the API returns."""

from __future__ import annotations

from typing import Any

from infergate.engine.registry import ModelRecord
from infergate.engine.served import ServedVersion


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
                "device": i.ready_info.device if i.ready_info else None,
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
