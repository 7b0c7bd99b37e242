"""Triton's load-time config override (`parameters.config`, a JSON string in Triton's
model-config schema) mapped onto model.toml's fields. Only fields with a model.toml
counterpart are taken; any other is refused by name, since silently ignoring it would
leave a client believing a setting took effect. An override lasts until the next explicit
load without one (as in Triton), so a file change picked up meanwhile keeps it."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import orjson

from infergate.engine.repository.spec import (
    BatchingOverrides,
    ModelConfig,
    ModelEntry,
    VersionPolicy,
)
from infergate.errors import BadRequest, shown

# instance_group kinds -> model.toml device ("" keeps it; "auto" prefers a GPU).
_KINDS = {"KIND_AUTO": "auto", "KIND_CPU": "cpu", "KIND_GPU": ""}

BACKENDS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch"}


_INTEGER = re.compile(r"-?[0-9]{1,18}")  # (ASCII digits, and few: int() has a limit)
_LARGEST = 2**63 - 1
_MOST_INSTANCES = 256  # as model.toml's `instances`

# Fields an override may carry without changing anything, when they agree with what serves.
_DESCRIPTIVE = ("name", "platform", "backend", "input", "output")


def _fail(name: str, message: str) -> BadRequest:
    return BadRequest(f"failed to load {name!r}: {message}")


def _integer(name: str, field: str, value: Any, minimum: int, maximum: int = _LARGEST) -> int:
    """Protobuf's JSON form allows integers as strings ("16"); Triton's clients send both."""
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        value = int(value)
    if type(value) is not int or not minimum <= value <= maximum:
        bounds = f">= {minimum}" if maximum == _LARGEST else f"from {minimum} to {maximum}"
        raise _fail(name, f"config field {field!r} must be an integer {bounds}, got {shown(value)}")
    return value


def _object(name: str, field: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(name, f"config field {field!r} must be an object, got {shown(value)}")
    return value


def _unknown(name: str, doc: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in doc:
        if key not in known:
            raise _fail(
                name,
                f"config field '{where}{key}' is not supported by infergate; supported: "
                f"{', '.join(where + k for k in known)}. Hint: set the rest in model.toml",
            )


def _override_version_policy(name: str, value: Any) -> VersionPolicy:
    doc = _object(name, "version_policy", value)
    if len(doc) != 1:
        raise _fail(name, "config field 'version_policy' needs one of latest, all or specific")
    kind, body = next(iter(doc.items()))
    body = _object(name, f"version_policy.{kind}", body)
    if kind == "all":
        _unknown(name, body, (), "version_policy.all.")
        return VersionPolicy(all=True)
    if kind == "latest":
        _unknown(name, body, ("num_versions",), "version_policy.latest.")
        count = _integer(name, "version_policy.latest.num_versions", body.get("num_versions"), 1)
        return VersionPolicy(latest=count)
    if kind == "specific":
        _unknown(name, body, ("versions",), "version_policy.specific.")
        raw = body.get("versions")
        if not isinstance(raw, list) or not raw:
            raise _fail(name, "config field 'version_policy.specific.versions' must be a list")
        versions = [_integer(name, "version_policy.specific.versions", v, 1) for v in raw]
        return VersionPolicy(versions=tuple(versions))
    raise _fail(name, f"config field 'version_policy.{kind}' is not latest, all or specific")


def _check_descriptive(name: str, doc: dict[str, Any], platform: str | None) -> None:
    """name/platform/backend may be restated; tensors are what the model file says."""
    if "name" in doc and doc["name"] != name:
        raise _fail(name, f"config field 'name' is {shown(doc['name'])}; it must be {name!r}")
    for field in ("platform", "backend"):
        if field in doc and platform is not None:
            mine = platform if field == "platform" else BACKENDS.get(platform, platform)
            if doc[field] != mine:
                raise _fail(
                    name,
                    f"config field {field!r} is {shown(doc[field])} but the model file runs on "
                    f"{mine!r}. Hint: the runtime follows the model file (or model.toml runtime)",
                )
    for field in ("input", "output"):
        if field in doc and not isinstance(doc[field], list):
            raise _fail(name, f"config field {field!r} must be a list of tensors")


def parse_override(name: str, text: Any, platform: str | None) -> dict[str, Any]:
    """Check a `parameters.config` override; the parsed document, or BadRequest naming the
    field (every message contains "failed to load", as Triton's clients check)."""
    if not isinstance(text, str):
        raise _fail(name, f"parameters.config must be a JSON string, got {type(text).__name__}")
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _fail(name, f"parameters.config is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _fail(name, "parameters.config must be a JSON object in Triton's config schema")
    known = (*_DESCRIPTIVE, "max_batch_size", "dynamic_batching", "instance_group")
    _unknown(name, doc, (*known, "version_policy"), "")
    _check_descriptive(name, doc, platform)
    apply_override(name, ModelConfig(), doc)  # raises on every bad value now, not at load
    return doc


def _instance_groups(name: str, groups: Any, config: ModelConfig) -> tuple[int, str]:
    """The instance count (summed over the groups) and the model.toml device. All of a
    version's instances are placed alike, so the groups' kinds must agree."""
    if not isinstance(groups, list) or not groups:
        raise _fail(name, "config field 'instance_group' must be a non-empty list")
    count, devices = 0, set()
    for i, group in enumerate(groups):
        group = _object(name, f"instance_group[{i}]", group)
        _unknown(name, group, ("name", "kind", "count"), f"instance_group[{i}].")
        field = f"instance_group[{i}].count"
        count += _integer(name, field, group.get("count", 1), 1, _MOST_INSTANCES)
        if count > _MOST_INSTANCES:
            raise _fail(
                name, f"config field 'instance_group' asks for {count} instances in all; "
                f"a model has at most {_MOST_INSTANCES}",
            )  # fmt: skip
        kind = group.get("kind")
        if kind is None:  # not said: model.toml's device stands
            devices.add(config.device)
        elif kind in _KINDS:
            devices.add(_KINDS[kind] or (config.device if config.device != "cpu" else "auto"))
        else:
            raise _fail(
                name,
                f"config field 'instance_group[{i}].kind' is {shown(kind)}; "
                f"expected one of {', '.join(_KINDS)}",
            )
    if len(devices) > 1:
        raise _fail(
            name,
            "config field 'instance_group' mixes kinds; infergate places every instance of "
            "a version alike. Hint: one group, or groups of one kind",
        )
    return count, devices.pop()


def apply_override(name: str, config: ModelConfig, doc: dict[str, Any]) -> ModelConfig:
    """model.toml's config with an override's fields on top."""
    batching = config.batching
    if "max_batch_size" in doc:
        size = _integer(name, "max_batch_size", doc["max_batch_size"], 0)
        batching = replace(batching, max_batch_size=size)
    if "dynamic_batching" in doc:
        dynamic = _object(name, "dynamic_batching", doc["dynamic_batching"])
        fields = ("max_queue_delay_microseconds", "preferred_batch_size")
        _unknown(name, dynamic, fields, "dynamic_batching.")
        if "max_queue_delay_microseconds" in dynamic:
            field = "dynamic_batching.max_queue_delay_microseconds"
            micros = _integer(name, field, dynamic["max_queue_delay_microseconds"], 0)
            batching = replace(batching, max_queue_delay_ms=micros / 1000.0)
        preferred = dynamic.get("preferred_batch_size", [])
        if preferred != []:  # (the config endpoint shows [], which may come back as it is)
            raise _fail(
                name,
                f"config field 'dynamic_batching.preferred_batch_size' is {shown(preferred)}; "
                "infergate's batcher has no preferred sizes (a batch is what queued, up to "
                "max_batch_size, within max_queue_delay_microseconds). Hint: leave it out, "
                "or empty",
            )
    instances, device = config.instances, config.device
    if "instance_group" in doc:
        instances, device = _instance_groups(name, doc["instance_group"], config)
    policy = config.version_policy
    if "version_policy" in doc:
        policy = _override_version_policy(name, doc["version_policy"])
    return replace(
        config,
        batching=BatchingOverrides(
            batching.max_batch_size, batching.max_queue_delay_ms, batching.max_queue_size
        ),
        instances=instances,
        device=device,
        version_policy=policy,
    )


class ConfigOverrides:
    """The override each model was last loaded with, applied to what the scan finds."""

    def __init__(self) -> None:
        self._docs: dict[str, dict[str, Any]] = {}

    def get(self, name: str) -> dict[str, Any] | None:
        return self._docs.get(name)

    def set(self, name: str, doc: dict[str, Any] | None) -> None:
        if doc is None:
            self._docs.pop(name, None)
        else:
            self._docs[name] = doc

    def apply(self, entry: ModelEntry | None) -> ModelEntry | None:
        doc = self._docs.get(entry.name) if entry is not None else None
        if entry is None or doc is None or entry.problem:
            return entry
        entry = replace(entry, config=apply_override(entry.name, entry.config, doc))
        if not entry.served_versions():
            on_disk = ", ".join(str(v.version) for v in entry.versions)
            problem = (
                "the config override's version_policy selects none of the versions on disk "
                f"({on_disk})"
            )
            return replace(entry, problem=problem)
        return entry
