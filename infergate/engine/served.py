"""A model version being served: its instances, its state, dispatch to them, and drain."""

from __future__ import annotations

import asyncio

from infergate.engine.context import EngineContext
from infergate.engine.instance import Instance
from infergate.engine.runtimes import unavailable_reason
from infergate.engine.spec import (
    PLATFORMS,
    ModelConfig,
    ModelEntry,
    ModelVersionFile,
    TensorSpec,
)
from infergate.engine.workers.messages import WorkerSpec
from infergate.errors import ModelNotReady, WorkerFailed
from infergate.tensors import Array

# The order a version's state is summarised in: the best instance wins.
_STATE_RANK = ["ready", "restarting", "loading", "failed", "stopped"]


class ServedVersion:
    def __init__(
        self, entry: ModelEntry, file: ModelVersionFile, sha256: str, context: EngineContext
    ) -> None:
        self.name = entry.name
        self.version = file.version
        self.file = file
        self.sha256 = sha256
        self.config: ModelConfig = entry.config
        self.platform = PLATFORMS[file.runtime]
        self.unavailable = unavailable_reason(file.runtime)
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        spec = WorkerSpec(
            model=entry.name,
            version=file.version,
            path=file.path,
            runtime=file.runtime,
            device=entry.config.device,
            inputs=entry.config.inputs,
            outputs=entry.config.outputs,
        )
        self.instances = [Instance(spec, i, context) for i in range(entry.config.instances)]

    def same_as(self, file: ModelVersionFile, sha256: str, config: ModelConfig) -> bool:
        """Would loading `file` again give what serves now?"""
        return self.file == file and self.sha256 == sha256 and self.config == config

    def start(self) -> None:
        if self.unavailable is None:
            for instance in self.instances:
                instance.start()

    async def wait_settled(self) -> None:
        if self.unavailable is None:
            await asyncio.gather(*(i.wait_settled() for i in self.instances))

    async def stop(self) -> None:
        await asyncio.gather(*(i.stop() for i in self.instances))

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
        states = {
            i.state if i.state != "ready" or i.ready else "restarting" for i in self.instances
        }
        return min(states, key=_STATE_RANK.index)

    @property
    def ready(self) -> bool:
        return any(i.ready for i in self.instances)

    @property
    def reason(self) -> str | None:
        if self.unavailable is not None:
            return self.unavailable
        reasons = [i.reason for i in self.instances if i.reason]
        return reasons[0] if reasons else None

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        info = next((i.ready_info for i in self.instances if i.ready_info), None)
        return info.inputs if info else self.config.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        info = next((i.ready_info for i in self.instances if i.ready_info), None)
        return info.outputs if info else self.config.outputs

    def not_ready_error(self) -> ModelNotReady:
        if self.state in ("loading", "restarting"):
            hint = "Hint: retry shortly"
        else:
            hint = "Hint: fix the model and reload it (infergate model status shows why)"
        why = f": {self.reason}" if self.reason else ""
        return ModelNotReady(
            f"model {self.name!r} version {self.version} is {self.state}{why}. {hint}"
        )

    def _pick(self, exclude: Instance | None = None) -> Instance:
        ready = [i for i in self.instances if i.ready and i is not exclude]
        if not ready:
            raise self.not_ready_error()
        return min(ready, key=lambda i: i.handle.busy if i.handle else 0)

    async def infer(
        self, inputs: dict[str, Array], outputs: list[str], timeout_s: float
    ) -> dict[str, Array]:
        # Counted from the same loop step that chose this version, so a drain never
        # misses a request that is about to start.
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._dispatch(inputs, outputs, timeout_s)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _dispatch(
        self, inputs: dict[str, Array], outputs: list[str], timeout_s: float
    ) -> dict[str, Array]:
        instance = self._pick()
        assert instance.handle is not None
        try:
            return await instance.handle.infer(inputs, outputs, timeout_s)
        except WorkerFailed:
            # Inference is idempotent: a request whose worker died gets one more try on
            # a sibling instance, when there is one.
            if not any(i.ready for i in self.instances if i is not instance):
                raise
            sibling = self._pick(exclude=instance)
            assert sibling.handle is not None
            return await sibling.handle.infer(inputs, outputs, timeout_s)
