"""model.toml's [sequence]: Triton's sequence batcher, in our words.

    [sequence]
    idle_timeout_ms = 1000     # Triton's max_sequence_idle_microseconds (default 1 s)
    max_sequences = 1024       # live at once; a start past it is a 503 (Retry-After)
    start = "START"            # control inputs the gateway feeds with each request
    end = "END"
    ready = "READY"
    corrid = "CORRID"
    [[sequence.state]]         # implicit state: zeros at start, carried, dropped at end
    input = "STATE_IN"
    output = "STATE_OUT"

Each control names a model input; its datatype and shape come from the model (1 or 0 in
that datatype, the correlation id for CORRID). The keys are declared in
infergate/settings/model_sections.py (SequenceSection); engine/repository/modelconfig.py
reads the table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # spec.py holds ModelConfig, which holds these settings
    from infergate.engine.repository.spec import TensorSpec

CONTROLS = ("start", "end", "ready", "corrid")


@dataclass(frozen=True)
class StatePair:
    """One implicit state: the model reads it from `input` and writes it to `output`."""

    input: str
    output: str


@dataclass(frozen=True)
class SequenceSettings:
    idle_timeout_s: float = 1.0
    max_sequences: int = 1024  # each holds its state in the gateway's memory: a bound
    controls: tuple[tuple[str, str], ...] = ()  # (kind in CONTROLS, model input name)
    states: tuple[StatePair, ...] = ()

    @property
    def fed_inputs(self) -> frozenset[str]:
        """The inputs the gateway fills, that a client must not send."""
        return frozenset([n for _, n in self.controls] + [s.input for s in self.states])

    @property
    def state_outputs(self) -> frozenset[str]:
        return frozenset(s.output for s in self.states)


def client_tensors(
    specs: tuple[TensorSpec, ...], sequence: SequenceSettings | None
) -> list[TensorSpec]:
    """The tensors a client sees (metadata, Triton's config): the gateway's own sequence
    tensors left out, as Triton leaves out control inputs and state."""
    if sequence is None:
        return list(specs)
    hidden = sequence.fed_inputs | sequence.state_outputs
    return [s for s in specs if s.name not in hidden]
