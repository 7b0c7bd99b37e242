"""Triton's model configuration (its JSON schema) for what serves: the tensors the worker
reported, the batching the scheduler uses, the instances placed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infergate.engine.repository.config_override import BACKENDS
from infergate.engine.repository.spec import TensorSpec, VersionPolicy
from infergate.engine.snapshots import VersionView
from infergate.engine.triton.sequence import sequence_batching

# Triton's model-config data types for the V2 datatypes (BYTES is TYPE_STRING there).
TRITON_TYPES = {
    "BOOL": "TYPE_BOOL",
    "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "UINT8": "TYPE_UINT8",
    "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64",
    "FP16": "TYPE_FP16",
    "FP32": "TYPE_FP32",
    "FP64": "TYPE_FP64",
    "BYTES": "TYPE_STRING",
}


def _tensor(spec: TensorSpec, batching: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if batching else spec.shape)
    return {
        "name": spec.name,
        "data_type": TRITON_TYPES.get(spec.datatype, "TYPE_INVALID"),
        "dims": dims,
    }


def _version_policy(policy: VersionPolicy) -> dict[str, Any]:
    if policy.all:
        return {"all": {}}
    if policy.versions:
        return {"specific": {"versions": list(policy.versions)}}
    return {"latest": {"num_versions": policy.latest}}


def _instance_group(view: VersionView) -> list[dict[str, Any]]:
    devices = [i.placed_on or "cpu" for i in view.instances]
    gpus = sorted({int(d.split(":")[1]) for d in devices if d.startswith("cuda:")})
    group: dict[str, Any] = {
        "name": view.name,
        "kind": "KIND_GPU" if gpus else "KIND_CPU",
        "count": len(view.instances),
    }
    if gpus:
        group["gpus"] = gpus
    return [group]


def model_config(view: VersionView) -> dict[str, Any]:
    """GET /v2/models/{m}[/versions/{v}]/config: Triton's schema, from what serves."""
    batching = view.max_batch_size > 0
    sequence = view.sequence
    doc: dict[str, Any] = {
        "name": view.name,
        "platform": view.platform,
        "backend": BACKENDS.get(view.platform, view.platform),
        "version_policy": _version_policy(view.version_policy),
        "max_batch_size": view.max_batch_size,
        "input": [_tensor(s, batching) for s in view.client_inputs],
        "output": [_tensor(s, batching) for s in view.client_outputs],
        "instance_group": _instance_group(view),
        "default_model_filename": Path(view.path).name,
        "parameters": {},
    }
    if sequence is not None:  # Triton's schedulers are one or the other
        doc["sequence_batching"] = sequence_batching(sequence, view.inputs, batching, TRITON_TYPES)
    elif batching:
        doc["dynamic_batching"] = {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(view.max_queue_delay_s * 1e6),
        }
    return doc
