"""model.toml's [sequence] as Triton's `sequence_batching` (model configuration), so that
Triton's tools (perf_analyzer) see a sequence model and send sequence ids."""

from __future__ import annotations

from typing import Any

from infergate.engine.repository.sequence_config import SequenceSettings
from infergate.engine.repository.spec import TensorSpec

_KINDS = {
    "start": "CONTROL_SEQUENCE_START",
    "end": "CONTROL_SEQUENCE_END",
    "ready": "CONTROL_SEQUENCE_READY",
    "corrid": "CONTROL_SEQUENCE_CORRID",
}


def _control(kind: str, spec: TensorSpec | None, types: dict[str, str]) -> dict[str, Any]:
    datatype = spec.datatype if spec else "INT32"
    control: dict[str, Any] = {"kind": _KINDS[kind]}
    if kind == "corrid":
        control["data_type"] = types.get(datatype, "TYPE_INVALID")
    elif datatype == "BOOL":
        control["bool_false_true"] = [False, True]
    elif datatype in ("FP16", "FP32", "FP64"):
        control["fp32_false_true"] = [0.0, 1.0]
    else:
        control["int32_false_true"] = [0, 1]
    return control


def sequence_batching(
    sequence: SequenceSettings,
    inputs: tuple[TensorSpec, ...],
    batching: bool,
    types: dict[str, str],
) -> dict[str, Any]:
    specs = {s.name: s for s in inputs}
    states = []
    for pair in sequence.states:
        spec = specs.get(pair.input)
        shape = spec.shape if spec else ()
        states.append(
            {
                "input_name": pair.input,
                "output_name": pair.output,
                "data_type": types.get(spec.datatype, "TYPE_INVALID") if spec else "TYPE_INVALID",
                "dims": list(shape[1:] if batching else shape),
            }
        )
    return {
        "max_sequence_idle_microseconds": round(sequence.idle_timeout_s * 1e6),
        "control_input": [
            {"name": name, "control": [_control(kind, specs.get(name), types)]}
            for kind, name in sequence.controls
        ],
        "state": states,
    }
