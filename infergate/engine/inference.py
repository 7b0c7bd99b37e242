"""The engine's request and result records: numpy tensors by name, no HTTP in sight.

NamedTuples, not frozen dataclasses: one of each is built per request, and a frozen
dataclass pays an object.__setattr__ call per field (about 4x the cost)."""

from __future__ import annotations

from typing import Any, NamedTuple

from infergate.engine.scheduling.sequences import SequenceParams
from infergate.tensors import Array


class InferenceRequest(NamedTuple):
    model: str
    inputs: dict[str, Array]
    version: int | None = None
    outputs: tuple[str, ...] | None = None  # None: every output
    timeout_s: float | None = None  # the client's own deadline, if it gave one
    priority: Any = None  # V2 parameters.priority: a class name, or tritonclient's integer
    session: str | None = None  # V2 parameters.session: keep these on one instance
    sequence: SequenceParams | None = None  # V2 parameters.sequence_id/_start/_end
    instance: int | None = None  # the only instance that may run it (a sequence's)


class InferenceResult(NamedTuple):
    model: str
    version: int
    outputs: dict[str, Array]
