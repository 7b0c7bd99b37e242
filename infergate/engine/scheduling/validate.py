"""Check a request's tensors against what the model declares, with messages that say
which input, what was expected and what came."""

from __future__ import annotations

from infergate.engine.repository.spec import TensorSpec
from infergate.errors import BadRequest
from infergate.tensors import Array, v2_datatype


def _describe(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(f"{s.name} ({s.datatype} {list(s.shape)})" for s in specs)


def check_inputs(model: str, specs: tuple[TensorSpec, ...], inputs: dict[str, Array]) -> None:
    expected = {s.name for s in specs}
    for name in inputs:
        if name not in expected:
            raise BadRequest(
                f"unexpected input {name!r} for model {model!r}; it expects {_describe(specs)}"
            )
    for spec in specs:
        array = inputs.get(spec.name)
        if array is None:
            raise BadRequest(
                f"input {spec.name!r} is missing; model {model!r} expects {_describe(specs)}"
            )
        got = v2_datatype(array.dtype)
        if got != spec.datatype:
            raise BadRequest(
                f"input {spec.name!r} has datatype {got} but model {model!r} expects "
                f"{spec.datatype}"
            )
        shape = tuple(array.shape)
        fits = len(shape) == len(spec.shape) and all(
            want < 0 or want == have for want, have in zip(spec.shape, shape, strict=True)
        )
        if not fits:
            raise BadRequest(
                f"input {spec.name!r} has shape {list(shape)} but model {model!r} expects "
                f"{list(spec.shape)} (-1 is any size)"
            )
    _check_empty(inputs)


def check_rows(model: str, inputs: dict[str, Array]) -> None:
    """A batched model's inputs all carry the request's rows in their first dimension: a
    request whose inputs disagree would be merged with other requests and cut back apart
    by the first input's rows, handing one caller's rows to another."""
    rows = {int(a.shape[0]) for a in inputs.values()}
    if len(rows) > 1:
        shapes = ", ".join(f"{n} {list(a.shape)}" for n, a in inputs.items())
        raise BadRequest(
            f"the inputs of model {model!r} have different batch sizes (first dimensions): "
            f"{shapes}. Hint: send the same number of rows in every input"
        )


def _check_empty(inputs: dict[str, Array]) -> None:
    """The worker's shared memory cannot carry a tensor without elements; a batch of zero
    rows never goes there (the engine answers it), so any other empty tensor is refused."""
    if all(a.shape[:1] == (0,) for a in inputs.values()):
        return  # an empty batch, or no inputs at all
    for name, array in inputs.items():
        if array.size == 0:
            raise BadRequest(
                f"input {name!r} has shape {list(array.shape)}, which holds no elements; an "
                "empty tensor is accepted only as an empty batch (the first dimension of "
                "every input 0). Hint: send at least one element, or no rows at all"
            )


def check_outputs(
    model: str, specs: tuple[TensorSpec, ...], wanted: tuple[str, ...] | None
) -> tuple[str, ...]:
    """The output names to compute; all of them when none were asked for."""
    names = tuple(s.name for s in specs)
    if wanted is None:
        return names
    for name in wanted:
        if name not in names:
            raise BadRequest(
                f"unknown output {name!r} requested from model {model!r}; it has {', '.join(names)}"
            )
    return tuple(dict.fromkeys(wanted))
