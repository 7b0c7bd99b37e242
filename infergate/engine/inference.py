"""The engine's request and result records: numpy tensors by name, no HTTP in sight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infergate.engine.scheduling.scheduler import Timing
from infergate.tensors import Array


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    model: str
    inputs: dict[str, Array]
    version: int | None = None
    outputs: tuple[str, ...] | None = None  # None: every output
    timeout_s: float | None = None  # the client's own deadline, if it gave one
    priority: Any = None  # V2 parameters.priority: a class name, or tritonclient's integer
    session: str | None = None  # V2 parameters.session: keep these on one instance


@dataclass(frozen=True, slots=True)
class InferenceResult:
    model: str
    version: int
    outputs: dict[str, Array] = field(default_factory=dict)
    timing: Timing | None = None
