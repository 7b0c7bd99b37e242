"""Parse model.toml into a ModelConfig."""

from __future__ import annotations

from pathlib import Path

from infergate.engine.remote.config import remote_config
from infergate.engine.repository.sequence_config import parse_sequence
from infergate.engine.repository.spec import (
    WARMUP_DATA,
    BatchingOverrides,
    ModelConfig,
    TensorSpec,
    VersionPolicy,
    Warmup,
)
from infergate.engine.runtimes import runtime_names
from infergate.errors import ConfigError
from infergate.settings.declare import given
from infergate.settings.profile_sections import BreakerSection
from infergate.settings.table import Table, load_toml
from infergate.tensors import V2_TO_NUMPY


def _tensor(table: Table) -> TensorSpec:
    name = table.string("name", None)
    datatype = table.string("datatype", None, choices=tuple(V2_TO_NUMPY))
    shape = table.array("shape", None)
    if name is None or datatype is None or shape is None:
        raise ConfigError(f"{table.where('')}: each tensor needs name, datatype and shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in shape):
        raise ConfigError(
            f"{table.where('shape')}: expected integers >= -1 (-1 is free), got {shape}"
        )
    table.reject_unknown()
    return TensorSpec(name=name, datatype=datatype, shape=tuple(shape))


def _version_policy(table: Table) -> VersionPolicy:
    latest = table.integer("latest", 1, minimum=1)
    every = table.boolean("all", False)
    versions = table.array("versions", [])
    if not all(isinstance(v, int) and v > 0 for v in versions):
        raise ConfigError(f"{table.where('versions')}: expected positive integers, got {versions}")
    table.reject_unknown()
    return VersionPolicy(latest=latest, all=every, versions=tuple(versions))


def _batching(table: Table) -> BatchingOverrides:
    overrides = BatchingOverrides(
        max_batch_size=table.integer("max_batch_size", None, minimum=0),
        max_queue_delay_ms=table.number("max_queue_delay_ms", None, minimum=0),
        max_queue_size=table.integer("max_queue_size", None, minimum=1),
    )
    table.reject_unknown()
    return overrides


def _breaker(table: Table) -> tuple[tuple[str, float], ...]:
    # The profile's declaration: window_seconds = 0 is refused here too.
    return tuple(given(table.read(BreakerSection)).items())


def _warmup(table: Table, folder: Path) -> Warmup:
    """[warmup]: data = "zeros" | "random" | "file" | "none"; low, high; file (beside
    model.toml, or absolute). A file alone means data = "file"."""
    file = table.string("file", None)
    data = table.string("data", "file" if file else "zeros", choices=WARMUP_DATA)
    low = table.number("low", 0.0)
    high = table.number("high", 1.0)
    if low is None or high is None or low > high:
        raise ConfigError(f"{table.where('low')}: expected low <= high, got {low} > {high}")
    path = None
    if data == "file":
        if file is None:
            raise ConfigError(
                f'{table.where("file")}: data = "file" needs file = "sample.npz" (a .npy, '
                ".npz or V2 JSON request file beside model.toml)"
            )
        path = Path(file) if Path(file).is_absolute() else folder / file
        if path.suffix not in (".npy", ".npz", ".json"):
            raise ConfigError(
                f"{table.where('file')}: expected a .npy, .npz or .json (V2 request) file, "
                f"got {file!r}"
            )
    table.reject_unknown()
    return Warmup(data=data, low=low, high=high, file=path)


def parse_model_config(path: Path) -> ModelConfig:
    table = Table(load_toml(path), path)
    runtime = table.string("runtime", None, choices=runtime_names())
    config = ModelConfig(
        runtime=runtime,
        instances=table.integer("instances", 1, minimum=1),
        threads=table.integer("threads", None, minimum=1),
        device=table.string("device", "auto"),
        timeout_s=table.number("timeout_ms", 30_000.0, minimum=1) / 1000.0,
        inputs=tuple(_tensor(t) for t in table.tables("inputs")),
        outputs=tuple(_tensor(t) for t in table.tables("outputs")),
        version_policy=_version_policy(table.table("version_policy")),
        batching=_batching(table.table("batching")),
        breaker=_breaker(table.table("breaker")),
        memory_mb=table.integer("memory_mb", None, minimum=1),
        sha256=table.string("sha256", None),
        tenant=table.string("tenant", "default"),
        warmup=_warmup(table.table("warmup"), path.parent),
        sequence=parse_sequence(table.table("sequence"), table.has("sequence")),
        remote=remote_config(table.table("remote"), runtime),
    )
    table.reject_unknown()
    return config
