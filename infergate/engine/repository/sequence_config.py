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
that datatype, the correlation id for CORRID)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from infergate.errors import ConfigError
from infergate.settings.table import Table

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


def _state(table: Table) -> StatePair:
    given = table.string("input", None), table.string("output", None)
    table.reject_unknown()
    if given[0] is None or given[1] is None:
        raise ConfigError(
            f"{table.where('')}: each [[sequence.state]] needs input and output (the model's "
            'state tensors), e.g. input = "STATE_IN", output = "STATE_OUT"'
        )
    return StatePair(given[0], given[1])


def parse_sequence(table: Table, present: bool) -> SequenceSettings | None:
    """The [sequence] table, or None when model.toml has none (the model takes no
    sequences)."""
    if not present:
        return None
    timeout_ms = table.number("idle_timeout_ms", 1000.0, minimum=1)
    most = table.integer("max_sequences", 1024, minimum=1)
    controls = tuple(
        (kind, name) for kind in CONTROLS if (name := table.string(kind, None)) is not None
    )
    states = tuple(_state(t) for t in table.tables("state"))
    table.reject_unknown()
    fed = [n for _, n in controls] + [s.input for s in states]
    twice = sorted({n for n in fed if fed.count(n) > 1})
    if twice:
        raise ConfigError(
            f"{table.where('')}: input {twice[0]!r} is named twice; each control and state "
            "input must be its own model input"
        )
    return SequenceSettings(timeout_ms / 1000.0, most, controls, states)
