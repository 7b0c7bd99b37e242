"""Messages on the control pipe between the gateway and a worker. Tensors are not in
them: a TensorRef points into a shared-memory arena."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infergate.engine.spec import RuntimeName, TensorSpec


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to load its model instance."""

    model: str
    version: int
    path: Path
    runtime: RuntimeName
    device: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    threads: int | None = None


@dataclass(frozen=True)
class TensorRef:
    """A tensor laid out in an arena at `offset`; BYTES use the V2 length-prefixed format."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Ready:
    pid: int
    device: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    load_s: float


@dataclass(frozen=True)
class LoadFailed:
    reason: str


@dataclass(frozen=True)
class InferCall:
    id: int
    in_arena: str
    out_arena: str
    out_capacity: int
    inputs: tuple[TensorRef, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class InferDone:
    id: int
    outputs: tuple[TensorRef, ...]
    # Outputs too big for the output arena come inline, once; the gateway then grows it.
    inline: dict[str, bytes] | None = None
    needed: int = 0


@dataclass(frozen=True)
class InferFailed:
    id: int
    reason: str


@dataclass(frozen=True)
class Stop:
    pass


ToWorker = InferCall | Stop
FromWorker = Ready | LoadFailed | InferDone | InferFailed
