"""The engine façade the HTTP layer calls: what is served, and inference on it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from infergate.clock import Clock, MonotonicClock
from infergate.engine.inference import InferenceRequest, InferenceResult
from infergate.engine.repository import scan_repository
from infergate.engine.served import ServedVersion
from infergate.engine.spec import ModelEntry
from infergate.engine.validate import check_inputs, check_outputs
from infergate.errors import ModelNotFound

log = logging.getLogger("infergate.engine")


@dataclass(frozen=True)
class EngineSettings:
    models_dir: Path
    load_timeout_s: float = 120.0


@dataclass
class ModelRecord:
    """A model the repository holds, and the versions of it being served."""

    entry: ModelEntry
    versions: dict[int, ServedVersion]

    @property
    def name(self) -> str:
        return self.entry.name

    def default_version(self) -> ServedVersion | None:
        """The highest served version that is ready, else the highest at all."""
        ordered = sorted(self.versions.values(), key=lambda v: v.version)
        ready = [v for v in ordered if v.ready]
        candidates = ready or ordered
        return candidates[-1] if candidates else None

    @property
    def state(self) -> str:
        if self.entry.problem:
            return "failed"
        default = self.default_version()
        return default.state if default else "unavailable"

    @property
    def reason(self) -> str | None:
        if self.entry.problem:
            return self.entry.problem
        default = self.default_version()
        return default.reason if default else None


class Engine:
    def __init__(self, settings: EngineSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or MonotonicClock()
        self._models: dict[str, ModelRecord] = {}
        self._loaded = asyncio.Event()

    async def start(self) -> None:
        """Scan the repository and start loading every model; returns without waiting."""
        for entry in scan_repository(self.settings.models_dir):
            versions = {
                f.version: ServedVersion(entry, f, self.clock, self.settings.load_timeout_s)
                for f in entry.served_versions()
            }
            self._models[entry.name] = ModelRecord(entry, versions)
            if entry.problem:
                log.error("model %s: %s", entry.name, entry.problem)
            for served in versions.values():
                served.start()
        asyncio.create_task(self._mark_loaded(), name="engine:initial-load")

    async def _mark_loaded(self) -> None:
        await asyncio.gather(
            *(v.wait_settled() for m in self._models.values() for v in m.versions.values())
        )
        self._loaded.set()
        for model in self._models.values():
            log.info("model %s: %s", model.name, model.state)

    async def wait_loaded(self) -> None:
        """Until every model's first load has ended, in success or failure."""
        await self._loaded.wait()

    @property
    def ready(self) -> bool:
        return self._loaded.is_set()

    async def stop(self) -> None:
        await asyncio.gather(
            *(v.stop() for m in self._models.values() for v in m.versions.values())
        )

    def models(self) -> list[ModelRecord]:
        return [self._models[k] for k in sorted(self._models)]

    def model(self, name: str) -> ModelRecord:
        try:
            return self._models[name]
        except KeyError:
            known = ", ".join(sorted(self._models)) or "none"
            raise ModelNotFound(
                f"unknown model {name!r}; served models: {known}. Hint: infergate model list"
            ) from None

    def version(self, name: str, version: int | None = None) -> ServedVersion:
        record = self.model(name)
        if version is None:
            served = record.default_version()
            if served is None:
                raise ModelNotFound(
                    f"model {name!r} has no servable version: {record.reason or 'none on disk'}"
                )
            return served
        try:
            return record.versions[version]
        except KeyError:
            live = ", ".join(str(v) for v in sorted(record.versions)) or "none"
            raise ModelNotFound(
                f"model {name!r} has no version {version} being served; live versions: {live}"
            ) from None

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        served = self.version(request.model, request.version)
        if not served.ready:
            raise served.not_ready_error()
        check_inputs(served.name, served.inputs, request.inputs)
        outputs = check_outputs(served.name, served.outputs, request.outputs)
        timeout = served.config.timeout_s
        if request.timeout_s is not None:
            timeout = min(timeout, request.timeout_s)
        result = await served.infer(request.inputs, outputs, timeout)
        return InferenceResult(served.name, served.version, result)
