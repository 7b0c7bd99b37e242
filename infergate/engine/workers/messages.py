"""Messages on the control pipe between the gateway and a worker. Tensors are not in
them: a TensorRef points into a shared-memory arena."""

from __future__ import annotations

import marshal
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from infergate.engine.repository.spec import RuntimeName, TensorSpec, Warmup


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
    memory_mb: int | None = None  # a cap for the runtime's allocator, where it has one
    env: tuple[tuple[str, str], ...] = ()  # set before the runtime loads (CUDA_VISIBLE_DEVICES)
    cpus: tuple[int, ...] | None = None  # CPU affinity, for CPU workers
    nice: int = 0  # added to the gateway's niceness: the gateway goes first on a busy CPU
    warmup: Warmup = Warmup()  # what the worker runs before it says it is ready
    source: Path | None = None  # the repository's file `path` is a verified copy of


# The messages on every request's path (TensorRef, InferCall, InferDone, InferFailed) are
# named tuples: read off the pipe, each is built in one step, where a frozen dataclass sets
# its fields one by one (half the decoding time of a reply).


class TensorRef(NamedTuple):
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
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES as the worker saw it


@dataclass(frozen=True)
class LoadFailed:
    reason: str


class InferCall(NamedTuple):
    id: int
    in_arena: str
    out_arena: str
    out_capacity: int
    inputs: tuple[TensorRef, ...]
    outputs: tuple[str, ...]


class InferDone(NamedTuple):
    id: int
    outputs: tuple[TensorRef, ...]
    # Outputs too big for the output arena come inline, once; the gateway then grows it.
    inline: dict[str, bytes] | None = None
    needed: int = 0


class InferFailed(NamedTuple):
    id: int
    reason: str
    request_fault: bool = False  # the data cannot be served (DataNotServable), not a model bug


@dataclass(frozen=True)
class Stop:
    pass


ToWorker = InferCall | Stop
FromWorker = Ready | LoadFailed | InferDone | InferFailed


# The wire. Calls and replies are on every request's path, so they travel as marshal'd
# tuples (a few microseconds) rather than pickled dataclasses (tens of microseconds, most of
# it looking classes up by name). The rare control messages are pickled. Both ends run the
# same interpreter, which marshal requires.
_CALL, _DONE, _FAILED, _PICKLED = 1, 2, 3, 4


def _refs(refs: tuple[TensorRef, ...]) -> tuple[tuple[str, str, tuple[int, ...], int, int], ...]:
    # marshal takes plain tuples only
    return tuple([(r.name, r.datatype, r.shape, r.offset, r.nbytes) for r in refs])


def encode(message: ToWorker | FromWorker) -> bytes:
    if isinstance(message, InferCall):
        m = message
        body = (_CALL, m.id, m.in_arena, m.out_arena, m.out_capacity, _refs(m.inputs), m.outputs)
        return marshal.dumps(body)
    if isinstance(message, InferDone):
        return marshal.dumps(
            (_DONE, message.id, _refs(message.outputs), message.inline, message.needed)
        )
    if isinstance(message, InferFailed):
        return marshal.dumps((_FAILED, message.id, message.reason, message.request_fault))
    return marshal.dumps((_PICKLED, pickle.dumps(message)))


_ref = TensorRef._make


def decode(raw: bytes) -> ToWorker | FromWorker:
    body = marshal.loads(raw)
    tag = body[0]
    if tag == _CALL:
        _, id_, in_arena, out_arena, capacity, refs, outputs = body
        return InferCall(id_, in_arena, out_arena, capacity, tuple(map(_ref, refs)), outputs)
    if tag == _DONE:
        _, id_, refs, inline, needed = body
        return InferDone(id_, tuple(map(_ref, refs)), inline, needed)
    if tag == _FAILED:
        return InferFailed(body[1], body[2], body[3])
    message: ToWorker | FromWorker = pickle.loads(body[1])
    return message
