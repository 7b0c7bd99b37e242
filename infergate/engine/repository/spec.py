"""Records that describe models: tensors, per-model configuration, versions on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from infergate.engine.remote.config import RemoteConfig
from infergate.engine.repository.sequence_config import SequenceSettings

RuntimeName = str  # a name in the runtime registry (infergate.engine.runtimes)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output; -1 in `shape` is a free dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions serve: the highest `latest`, every one (`all`), or those listed."""

    latest: int = 1
    all: bool = False
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        ordered = sorted(available)
        if self.all:
            return ordered
        if self.versions:
            return [v for v in ordered if v in self.versions]
        return ordered[-self.latest :]


@dataclass(frozen=True)
class BatchingOverrides:
    """model.toml's [batching]: each unset key takes the profile's value."""

    max_batch_size: int | None = None  # 0 turns batching off for this model
    max_queue_delay_ms: float | None = None
    max_queue_size: int | None = None


WARMUP_DATA = ("zeros", "random", "file", "none")


@dataclass(frozen=True)
class Warmup:
    """model.toml's [warmup], as Triton's model_warmup: what the worker runs once before
    it says it is ready. Free dimensions are 1 (zeros, random)."""

    data: str = "zeros"  # zeros, random (in [low, high]), file, none
    low: float = 0.0
    high: float = 1.0
    file: Path | None = None  # .npy (one input), .npz (by input name) or a V2 JSON request
    folder: Path | None = None  # the model's folder, which `file` must lie in (links too)

    def describe(self) -> str:
        if self.data == "random":
            return f"random values in [{self.low:g}, {self.high:g}], free dimensions 1"
        if self.data == "file":
            return f"the sample file {self.file}"
        return "zeros (empty strings for BYTES), free dimensions 1"


@dataclass(frozen=True)
class ModelConfig:
    """What model.toml says; every field has a default so the file is optional."""

    runtime: RuntimeName | None = None
    instances: int = 1
    threads: int | None = None  # intra-op threads per instance; None: the runtime's default
    device: str = "auto"
    timeout_s: float = 30.0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    batching: BatchingOverrides = field(default_factory=BatchingOverrides)
    breaker: tuple[tuple[str, float], ...] = ()  # model.toml [breaker] keys over the profile's
    memory_mb: int | None = None  # per instance; the worker is killed past it
    tenant: str = "default"  # whose devices and memory quota the instances use
    sha256: str | None = None
    warmup: Warmup = field(default_factory=Warmup)
    sequence: SequenceSettings | None = None  # [sequence]: None takes no sequences
    remote: RemoteConfig | None = None  # [remote], for runtime = "remote"


@dataclass(frozen=True)
class ModelVersionFile:
    version: int
    path: Path
    runtime: RuntimeName


@dataclass(frozen=True)
class ModelEntry:
    """A model as found in the repository: its config, versions on disk and any problems."""

    name: str
    config: ModelConfig
    versions: tuple[ModelVersionFile, ...]
    problem: str | None = None
    # The SHA256 of the model.toml bytes `config` was parsed from (None: no model.toml): a
    # remote model's digest, verified as its file (remote/served.py `verified_config`).
    toml_sha256: str | None = None

    def served_versions(self) -> list[ModelVersionFile]:
        wanted = set(self.config.version_policy.select([v.version for v in self.versions]))
        return [v for v in self.versions if v.version in wanted]
