"""Parse model.toml into a ModelConfig: each table is checked by its declaration
(infergate/settings/model_sections.py; [batching] and [breaker] are the profile's)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from infergate.engine.remote.config import RemoteConfig
from infergate.engine.repository.sequence_config import CONTROLS, SequenceSettings, StatePair
from infergate.engine.repository.spec import (
    BatchingOverrides,
    ModelConfig,
    TensorSpec,
    VersionPolicy,
    Warmup,
)
from infergate.engine.runtimes import runtime_names
from infergate.errors import ConfigError
from infergate.settings.declare import given
from infergate.settings.model_sections import (
    ModelSection,
    RemoteSection,
    SequenceSection,
    StateSection,
    TensorSection,
    VersionPolicySection,
    WarmupSection,
)
from infergate.settings.profile_sections import BatchingSection, BreakerSection
from infergate.settings.table import Table, load_toml, parse_toml


def _tensor(table: Table) -> TensorSpec:
    t = table.read(TensorSection)
    if t.name is None or t.datatype is None or t.shape is None:
        raise ConfigError(f"{table.where('')}: each tensor needs name, datatype and shape")
    return TensorSpec(name=t.name, datatype=t.datatype, shape=tuple(t.shape))


def _version_policy(table: Table) -> VersionPolicy:
    v = table.read(VersionPolicySection)
    return VersionPolicy(latest=v.latest, all=v.all, versions=tuple(v.versions))


def _batching(table: Table) -> BatchingOverrides:
    """The profile's [batching] declaration; a key left out takes the profile's value."""
    b = given(table.read(BatchingSection))
    return BatchingOverrides(**b)


def _breaker(table: Table) -> tuple[tuple[str, float], ...]:
    # The profile's declaration: window_seconds = 0 is refused here too.
    return tuple(given(table.read(BreakerSection)).items())


def _warmup(table: Table, folder: Path) -> Warmup:
    """[warmup]: data = "zeros" | "random" | "file" | "none"; low, high; file (in the
    model's folder). A file alone means data = "file"."""
    w = table.read(WarmupSection)
    data = w.data or ("file" if w.file else "zeros")
    if w.low > w.high:
        raise ConfigError(f"{table.where('low')}: expected low <= high, got {w.low} > {w.high}")
    path = None
    if data == "file":
        if w.file is None:
            raise ConfigError(
                f'{table.where("file")}: data = "file" needs file = "sample.npz" (a .npy, '
                ".npz or V2 JSON request file beside model.toml)"
            )
        given = Path(w.file)
        if given.is_absolute() or ".." in given.parts:
            # Whoever writes a model's folder names what its warm-up reads: not any file
            # of the host's that the gateway's user may read.
            raise ConfigError(
                f"{table.where('file')}: expected a file in the model's folder, got "
                f"{w.file!r}. Hint: copy it beside model.toml and name it by its name"
            )
        path = folder / given
        if path.suffix not in (".npy", ".npz", ".json"):
            raise ConfigError(
                f"{table.where('file')}: expected a .npy, .npz or .json (V2 request) file, "
                f"got {w.file!r}"
            )
    where = folder if path is not None else None  # (as `file`: only a file's warm-up)
    return Warmup(data=data, low=w.low, high=w.high, file=path, folder=where)


def _state(table: Table) -> StatePair:
    state = table.read(StateSection)
    if state.input is None or state.output is None:
        raise ConfigError(
            f"{table.where('')}: each [[sequence.state]] needs input and output (the model's "
            'state tensors), e.g. input = "STATE_IN", output = "STATE_OUT"'
        )
    return StatePair(state.input, state.output)


def _sequence(table: Table, present: bool) -> SequenceSettings | None:
    """[sequence], or None when model.toml has none (the model takes no sequences)."""
    if not present:
        return None
    seq = table.read(SequenceSection, leave=("state",))
    named = {"start": seq.start, "end": seq.end, "ready": seq.ready, "corrid": seq.corrid}
    controls = tuple((kind, name) for kind in CONTROLS if (name := named[kind]) is not None)
    states = tuple(_state(t) for t in table.tables("state"))
    fed = [n for _, n in controls] + [s.input for s in states]
    twice = sorted({n for n in fed if fed.count(n) > 1})
    if twice:
        raise ConfigError(
            f"{table.where('')}: input {twice[0]!r} is named twice; each control and state "
            "input must be its own model input"
        )
    return SequenceSettings(seq.idle_timeout_ms / 1000.0, seq.max_sequences, controls, states)


def _endpoint(table: Table, raw: str) -> str:
    text = raw.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise ConfigError(
            f"{table.where('endpoints')}: {raw!r} is not a V2 base URL. Hint: write it as "
            '"http://host:port" (the part before /v2)'
        )
    return text


def _remote(table: Table, runtime: str | None) -> RemoteConfig | None:
    """[remote] for runtime = "remote"; a [remote] on any other model is a mistake."""
    if runtime != "remote":
        if table.names():
            raise ConfigError(
                f'{table.where("")}: a [remote] table needs runtime = "remote" at the top of '
                "model.toml"
            )
        return None
    r = table.read(RemoteSection)
    if not r.endpoints:
        raise ConfigError(
            f'{table.where("endpoints")}: runtime = "remote" needs at least one endpoint. '
            'Hint: [remote] endpoints = ["http://host:8000"]'
        )
    endpoints = tuple(_endpoint(table, e) for e in r.endpoints)
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"{table.where('endpoints')}: an endpoint is listed twice")
    rest = r.model_dump(exclude={"endpoints", "model", "version", "connect_timeout_ms"})
    return RemoteConfig(
        endpoints=endpoints,
        model=r.model,
        version=None if r.version is None else str(r.version),
        connect_timeout_s=r.connect_timeout_ms / 1000.0,
        **rest,
    )


_TABLES = ("inputs", "outputs", "version_policy", "batching", "breaker", "warmup", "sequence")


def _runtime(table: Table, runtime: str | None) -> str | None:
    """The runtime registry is the engine's, so its names are checked here."""
    names = runtime_names()
    if runtime is not None and runtime not in names:
        raise ConfigError(
            f"{table.where('runtime')}: expected one of {', '.join(names)}, got {runtime!r}"
        )
    return runtime


def parse_model_config(path: Path, data: bytes | None = None) -> ModelConfig:
    """The model.toml at `path` (`data`: its bytes, already read)."""
    table = Table(load_toml(path) if data is None else parse_toml(path, data), path)
    top = table.read(ModelSection, leave=(*_TABLES, "remote"))
    runtime = _runtime(table, top.runtime)
    config = ModelConfig(
        runtime=runtime,
        instances=top.instances,
        threads=top.threads,
        device=top.device,
        timeout_s=top.timeout_ms / 1000.0,
        inputs=tuple(_tensor(t) for t in table.tables("inputs")),
        outputs=tuple(_tensor(t) for t in table.tables("outputs")),
        version_policy=_version_policy(table.table("version_policy")),
        batching=_batching(table.table("batching")),
        breaker=_breaker(table.table("breaker")),
        memory_mb=top.memory_mb,
        sha256=top.sha256,
        tenant=top.tenant,
        warmup=_warmup(table.table("warmup"), path.parent),
        sequence=_sequence(table.table("sequence"), table.has("sequence")),
        remote=_remote(table.table("remote"), runtime),
    )
    table.reject_unknown()
    return config
