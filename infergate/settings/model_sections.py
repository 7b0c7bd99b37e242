"""model.toml's settings, declared once: each table's keys with their types, defaults,
bounds and help (a default the engine's record holds is taken from it).
engine/repository/modelconfig.py reads model.toml with them; [batching] and [breaker] are the
profile's own declarations (profile_sections.py), each key a table sets overriding the
profile's. The README's reference is generated from them (reference.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from infergate.engine.remote.config import RemoteConfig
from infergate.engine.repository.sequence_config import SequenceSettings
from infergate.engine.repository.spec import ModelConfig, VersionPolicy, Warmup
from infergate.settings.declare import Section, setting
from infergate.tensors import V2_TO_NUMPY

# Defaults the engine's records hold are taken from them, so each is written once.
_MODEL = ModelConfig()
_VERSIONS = VersionPolicy()
_WARMUP = Warmup()
_SEQUENCE = SequenceSettings()
_REMOTE = RemoteConfig(())

WarmupData = Literal["zeros", "random", "file", "none"]


def _datatype(value: str) -> str:
    if value not in V2_TO_NUMPY:
        raise ValueError(value)
    return value


# One of KServe V2's datatypes (infergate/tensors.py maps each to numpy).
Datatype = Annotated[str, AfterValidator(_datatype)]


class ModelSection(Section):
    """every key is optional, and so is model.toml."""

    runtime: str | None = setting(
        None,
        'onnx, torchscript or remote (default: from the file\'s extension); "remote" is a '
        "model on other V2 servers",
    )
    instances: int = setting(
        _MODEL.instances,
        "worker processes (each loads its own copy)",
        ge=1,
        le=256,
    )
    threads: int | None = setting(
        None, "intra-op threads per instance (default: its share of the cores)", ge=1
    )
    device: str = setting(
        _MODEL.device,
        '"auto" (a GPU when one is there), "cpu", or "cuda:1"',
    )
    timeout_ms: float = setting(
        _MODEL.timeout_s * 1000.0,
        "execution timeout: past it the worker is killed and restarted (remote: the whole "
        "upstream exchange)",
        ge=1,
        unit="ms",
    )
    memory_mb: int | None = setting(
        None,
        "per instance: reserved on its device, and the worker is killed past it",
        ge=1,
        unit="MB",
    )
    sha256: str | None = setting(None, "pins the file: any other content is refused")
    tenant: str = setting(
        _MODEL.tenant,
        "whose devices and memory quota the instances use",
    )


class VersionPolicySection(Section):
    """[version_policy]: which versions serve: the highest `latest`, `all`, or `versions`."""

    latest: int = setting(
        _VERSIONS.latest,
        "the highest N versions serve",
        ge=1,
    )
    all: bool = setting(
        _VERSIONS.all,
        "every version serves",
    )
    versions: list[Annotated[int, Field(gt=0)]] = setting(
        [], "the versions listed serve", expected="positive integers"
    )


class WarmupSection(Section):
    """[warmup]: the one run before a version serves (as Triton's model_warmup)."""

    data: WarmupData | None = setting(
        None,
        "zeros, random (in [low, high]), file, or none (default: file when file is set, "
        "else zeros)",
    )
    low: float = setting(
        _WARMUP.low,
        "random values' lower bound",
    )
    high: float = setting(
        _WARMUP.high,
        "random values' upper bound",
    )
    file: str | None = setting(
        None,
        "in the model's folder, at most 64 MiB, rows first: .npy (one input), .npz (by "
        "input name) or a V2 JSON request",
    )


class SequenceSection(Section):
    """[sequence]: the model serves sequences (Triton's sequence batcher)."""

    idle_timeout_ms: float = setting(
        _SEQUENCE.idle_timeout_s * 1000.0,
        "a sequence idle this long is dropped with its state",
        ge=1,
        unit="ms",
    )
    max_sequences: int = setting(
        _SEQUENCE.max_sequences,
        "live at once (each holds its state in the gateway); past it a start is 503",
        ge=1,
        le=1_000_000,
    )
    start: str | None = setting(None, "control input: 1 on a sequence's first request, else 0")
    end: str | None = setting(None, "control input: 1 on a sequence's last request, else 0")
    ready: str | None = setting(None, "control input: always 1")
    corrid: str | None = setting(None, "control input: the sequence's correlation id")


class StateSection(Section):
    """[[sequence.state]]: implicit state, zeros at the start, carried, dropped at the end;
    each needs input and output."""

    input: str | None = setting(None, "the model input the state is fed to")
    output: str | None = setting(None, "the model output that is the next request's state")


class TensorSection(Section):
    """[[inputs]], [[outputs]]: required for TorchScript; ONNX reads them from the graph.
    Each needs name, datatype and shape."""

    name: str | None = setting(None, "the tensor's name")
    datatype: Datatype | None = setting(
        None, "a KServe V2 datatype", expected="one of " + ", ".join(V2_TO_NUMPY)
    )
    shape: list[Annotated[int, Field(ge=-1)]] | None = setting(
        None, "dimensions; -1 is free", expected="integers >= -1 (-1 is free)"
    )


class RemoteSection(Section):
    """[remote]: for runtime = "remote", the upstream V2 servers and how they are reached
    (defaults are Envoy's where it has one)."""

    endpoints: list[str] = setting(
        [],
        'V2 base URLs (before /v2), e.g. ["http://10.0.0.5:8000"]; at least one',
        expected="a list of strings",
    )
    model: str | None = setting(None, "its name upstream (default: this folder's name)")
    version: int | None = setting(None, "pin the upstream version (default: the upstream's)", ge=1)
    max_connections: int = setting(
        _REMOTE.max_connections,
        "connection pool per endpoint",
        ge=1,
    )
    max_keepalive: int = setting(
        _REMOTE.max_keepalive,
        "idle connections kept per endpoint",
        ge=0,
    )
    connect_timeout_ms: float = setting(
        _REMOTE.connect_timeout_s * 1000.0,
        "and never past the request's deadline to start",
        ge=1,
        unit="ms",
    )
    max_answer_mb: int = setting(
        _REMOTE.max_answer_mb,
        "an infer answer larger than this is a 502, not read on (it is held whole)",
        ge=1,
        unit="MB",
    )
    retries: int = setting(
        _REMOTE.retries,
        "on another endpoint, for a failed connection or a 503",
        ge=0,
    )
    retry_budget_percent: float = setting(
        _REMOTE.retry_budget_percent,
        "retries in flight at most this share of requests in flight",
        ge=0,
        unit="%",
    )
    min_retry_concurrency: int = setting(
        _REMOTE.min_retry_concurrency,
        "but always this many",
        ge=0,
    )
    health_interval_s: float = setting(
        _REMOTE.health_interval_s,
        "GET /v2/health/ready on every endpoint this often",
        ge=0.01,
        unit="s",
    )
    health_timeout_s: float = setting(
        _REMOTE.health_timeout_s,
        "a health check's timeout",
        ge=0.001,
        unit="s",
    )
    unhealthy_threshold: int = setting(
        _REMOTE.unhealthy_threshold,
        "failed checks in a row to mark an endpoint unhealthy",
        ge=1,
    )
    healthy_threshold: int = setting(
        _REMOTE.healthy_threshold,
        "passing checks in a row to bring it back",
        ge=1,
    )
    consecutive_5xx: int = setting(
        _REMOTE.consecutive_5xx,
        "5xx answers or failed connections in a row that eject an endpoint",
        ge=1,
    )
    interval_s: float = setting(
        _REMOTE.interval_s,
        "the ejection sweep's period",
        ge=0.001,
        unit="s",
    )
    base_ejection_time_s: float = setting(
        _REMOTE.base_ejection_time_s,
        "an ejection lasts this times the endpoint's ejection count",
        ge=0,
        unit="s",
    )
    max_ejection_time_s: float = setting(
        _REMOTE.max_ejection_time_s,
        "... capped at this",
        ge=0,
        unit="s",
    )
    max_ejection_percent: float = setting(
        _REMOTE.max_ejection_percent,
        "endpoints out at once, at most (but at least one may be)",
        ge=0,
        le=100,
        unit="%",
    )
