"""One request of a sequence: feed the control inputs (START, END, READY, CORRID) and the
implicit state to the model, run it on the sequence's instance, keep the new state.

Requests of one sequence run one after another, in arrival order; requests of different
sequences bound to one instance may share a batch (their state rows travel with them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from infergate.engine.inference import InferenceRequest, InferenceResult
from infergate.engine.lifecycle.served import ServedVersion
from infergate.engine.repository.sequence_config import SequenceSettings
from infergate.engine.repository.spec import TensorSpec
from infergate.engine.scheduling.sequences import (
    Sequence,
    SequenceId,
    SequenceParams,
    SequenceTable,
)
from infergate.engine.scheduling.validate import check_inputs
from infergate.errors import BadRequest, ModelFailed, WorkerFailed, shown
from infergate.tensors import Array, numpy_dtype

Run = Callable[[InferenceRequest], Awaitable[InferenceResult]]


async def infer_in_sequence(
    served: ServedVersion, request: InferenceRequest, run: Run, tenant: str = ""
) -> InferenceResult:
    """`run(request)` as a step of the request's sequence, `tenant`'s of that id (400
    when the model takes no sequences, or takes only sequences and the request names
    none)."""
    settings, params, table = served.config.sequence, request.sequence, served.sequences
    if settings is None or table is None:
        raise BadRequest(
            f"model {served.name!r} does not take sequences (its model.toml has no "
            "[sequence]), yet the request has parameters sequence_id/sequence_start/"
            "sequence_end. Hint: leave them out, or declare [sequence] in model.toml"
        )
    if params is None:
        raise BadRequest(
            f"model {served.name!r} serves sequences ([sequence] in its model.toml): each "
            "request needs parameters.sequence_id (a non-zero integer or a string), and the "
            "first one sequence_start = true. Hint: tritonclient's infer(..., sequence_id=1, "
            "sequence_start=True)"
        )
    sent = sorted(settings.fed_inputs & request.inputs.keys())
    if sent:
        raise BadRequest(
            f"input {shown(sent[0])} of model {served.name!r} is fed by the gateway (a sequence "
            "control or state input, [sequence] in model.toml). Hint: do not send it"
        )
    if not served.ready:  # its inputs are not known yet
        raise served.not_ready_error()
    # Checked before the sequence is touched: a bad request changes nothing, and no
    # tensor is built from a client's dimension before its shapes are known good.
    _check_request(served, settings, params, request)
    seq = table.open(params, served.instances, tenant)  # the tenant's sequence of that id
    try:
        async with seq.lock:
            return await _step(served, settings, table, seq, params, request, run)
    except BaseException:
        # A failed start never began; an end ends anyway. Any error, a bug's included, and
        # a cancel (its client left): a start left in the table would hold one of
        # max_sequences until its idle timeout.
        if params.start or params.end:
            table.close(seq)
        raise
    finally:
        table.release(seq)


async def _step(
    served: ServedVersion,
    settings: SequenceSettings,
    table: SequenceTable,
    seq: Sequence,
    params: SequenceParams,
    request: InferenceRequest,
    run: Run,
) -> InferenceResult:
    """Run one request of `seq`, which the caller holds locked, and keep its new state."""
    if not params.start:
        table.check(seq)  # its worker may have died while this request waited
    wanted = request.outputs
    if wanted:  # the state outputs are computed whatever the client asked for
        wanted = (*wanted, *sorted(settings.state_outputs - set(wanted)))
    fed = _fed(served, settings, params, seq.state, request)
    inputs = {**request.inputs, **fed}
    try:
        result = await run(
            request._replace(inputs=inputs, outputs=wanted, instance=seq.instance.index)
        )
    except WorkerFailed as exc:
        table.lose(seq, f"its worker died while running this request ({exc})")
        raise  # not reached: lose raises
    # It waited out a restart in the queue and ran on the new worker: the sequence is
    # lost all the same, as for every request after its worker died.
    table.check(seq, ran=True)
    outputs = dict(result.outputs)
    # A copy: the output may be a view of a whole batch, or of a reused buffer.
    seq.state = {s.input: np.array(outputs[s.output]) for s in settings.states}
    for name in settings.state_outputs:
        if not request.outputs or name not in request.outputs:
            outputs.pop(name, None)
    if params.end:
        table.close(seq)
    return result._replace(outputs=outputs)


def _check_request(
    served: ServedVersion,
    settings: SequenceSettings,
    params: SequenceParams,
    request: InferenceRequest,
) -> None:
    """What is wrong with the model's [sequence] (ModelFailed), else with the client's
    inputs (as the model declares them, less those the gateway feeds) or with a
    sequence_id its CORRID cannot hold (BadRequest)."""
    specs = {s.name: s for s in served.inputs}
    fed = settings.fed_inputs
    for name in sorted(fed):
        _spec(served, specs, name)
    check_inputs(served.name, tuple(s for s in served.inputs if s.name not in fed), request.inputs)
    for kind, name in settings.controls:
        if kind == "corrid":
            _check_corrid(served.name, specs[name], params.id)


def _fed(
    served: ServedVersion,
    settings: SequenceSettings,
    params: SequenceParams,
    state: dict[str, Array],
    request: InferenceRequest,
) -> dict[str, Array]:
    """The control and state tensors for this request, shaped for its rows (its inputs
    checked by `_check_request`: no row count here is one a client only claimed)."""
    specs = {s.name: s for s in served.inputs}
    first = next(iter(request.inputs.values()), None)
    rows = int(first.shape[0]) if first is not None and first.ndim else 1
    values = {"start": params.start, "end": params.end, "ready": True}
    fed: dict[str, Array] = {}
    for kind, name in settings.controls:
        spec = _spec(served, specs, name)
        shape = _shape(spec, rows)
        if kind == "corrid":
            fed[name] = _corrid(params, spec, shape)
        else:
            fed[name] = np.full(shape, values[kind], numpy_dtype(spec.datatype))
    for pair in settings.states:
        spec = _spec(served, specs, pair.input)
        shape = _shape(spec, rows)
        carried = state.get(pair.input)
        if carried is None:  # the start: zeros, as Triton's default initial state
            carried = np.zeros(shape, numpy_dtype(spec.datatype))
        elif carried.shape != shape:
            raise BadRequest(
                f"sequence {shown(params.id)} of model {served.name!r} carries state "
                f"{pair.input!r} of shape {list(carried.shape)}, but this request needs "
                f"{list(shape)} (a sequence keeps its number of rows). Hint: send every "
                "request of a sequence with the same batch size"
            )
        fed[pair.input] = carried
    return fed


def _spec(served: ServedVersion, specs: dict[str, TensorSpec], name: str) -> TensorSpec:
    spec = specs.get(name)
    if spec is None:
        raise ModelFailed(
            f"model {served.name!r}: [sequence] in model.toml names input {name!r}, which "
            f"the model does not have (it has {', '.join(sorted(specs))}). Hint: fix "
            "model.toml and reload the model"
        )
    return spec


def _shape(spec: TensorSpec, rows: int) -> tuple[int, ...]:
    """The declared shape with a free first dimension as the request's rows, any other
    free dimension 1."""
    dims = [max(d, 1) for d in spec.shape]
    if spec.shape and spec.shape[0] == -1:
        dims[0] = rows
    return tuple(dims)


# The integer datatypes a correlation id takes (and BYTES), as in Triton, with their range.
_CORRID_RANGES: dict[str, np.iinfo[Any]] = {
    "INT32": np.iinfo(np.int32),
    "INT64": np.iinfo(np.int64),
    "UINT32": np.iinfo(np.uint32),
    "UINT64": np.iinfo(np.uint64),
}


def _check_corrid(model: str, spec: TensorSpec, sid: SequenceId) -> None:
    """BadRequest for a sequence_id the model's CORRID input cannot hold (numpy would
    raise OverflowError: a 500 instead of the client's 400)."""
    if spec.datatype == "BYTES":
        return
    info = _CORRID_RANGES.get(spec.datatype)
    if info is None:
        raise ModelFailed(
            f"model {model!r}: [sequence] corrid names input {spec.name!r} of datatype "
            f"{spec.datatype}, but a correlation id is one of {', '.join(_CORRID_RANGES)} "
            "or BYTES, as in Triton. Hint: fix the model's CORRID input and reload it"
        )
    if isinstance(sid, str):
        raise BadRequest(
            f"model {model!r} takes its correlation id as {spec.datatype} (input "
            f"{spec.name!r}), but sequence_id is {shown(sid)}. Hint: send an integer "
            "sequence_id"
        )
    if not int(info.min) <= sid <= int(info.max):
        raise BadRequest(
            f"sequence_id {shown(sid)} is out of range for model {model!r}, which takes "
            f"its correlation id as {spec.datatype} (input {spec.name!r}): from "
            f"{info.min} to {info.max}. Hint: send a sequence_id in that range"
        )


def _corrid(params: SequenceParams, spec: TensorSpec, shape: tuple[int, ...]) -> Array:
    """The correlation id, its datatype checked by `_check_corrid`."""
    if spec.datatype == "BYTES":
        return np.full(shape, str(params.id).encode(), dtype=object)
    return np.full(shape, params.id, numpy_dtype(spec.datatype))
