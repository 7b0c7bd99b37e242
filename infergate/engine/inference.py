"""The engine's request and result records: numpy tensors by name, no HTTP in sight."""

from __future__ import annotations

from dataclasses import dataclass, field

from infergate.tensors import Array


@dataclass(frozen=True)
class InferenceRequest:
    model: str
    inputs: dict[str, Array]
    version: int | None = None
    outputs: tuple[str, ...] | None = None  # None: every output
    timeout_s: float | None = None  # the client's own deadline, if it gave one


@dataclass(frozen=True)
class InferenceResult:
    model: str
    version: int
    outputs: dict[str, Array] = field(default_factory=dict)
