"""The worker loop: load one model instance, warm it up, then answer InferCalls.

Runs in a process forked from the fork server (infergate.engine.workers.starting). It
imports the runtime's library; the gateway never does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection

from infergate import procname
from infergate.engine.repository.spec import TensorSpec
from infergate.engine.runtimes import open_runtime
from infergate.engine.runtimes.base import Runtime, WarmupInputError, warmup_inputs
from infergate.engine.workers.messages import (
    InferCall,
    InferDone,
    InferFailed,
    LoadFailed,
    Ready,
    Stop,
    TensorRef,
    WorkerSpec,
    decode,
    encode,
)
from infergate.engine.workers.shm import MappedArena, layout_size, read_tensor, write_tensors
from infergate.errors import DataNotServable, WarmupFailed
from infergate.tensors import to_wire, v2_datatype


def _check_declared(
    kind: str, declared: tuple[TensorSpec, ...], found: tuple[TensorSpec, ...]
) -> None:
    """model.toml's inputs/outputs, when it declares them, must be what the file has."""
    if declared and declared != found:

        def show(specs: tuple[TensorSpec, ...]) -> str:
            return ", ".join(f"{s.name} {s.datatype} {list(s.shape)}" for s in specs)

        raise ValueError(
            f"the file's {kind} ({show(found)}) differ from model.toml's ({show(declared)}). "
            f"Hint: make model.toml's [[{kind}]] say what the file has, or replace the file"
        )


def _load(spec: WorkerSpec) -> Runtime:
    runtime = open_runtime(
        spec.runtime,
        spec.path,
        spec.device,
        spec.inputs,
        spec.outputs,
        spec.threads,
        spec.memory_mb,
    )
    _check_declared("inputs", spec.inputs, runtime.inputs)
    _check_declared("outputs", spec.outputs, runtime.outputs)
    _warm_up(runtime, spec)
    return runtime


_WARMUP_HINT = (
    'Hint: choose the warm-up in model.toml\'s [warmup]: data = "random" with low and '
    'high, file = "sample.npz" beside model.toml (.npy, .npz or a V2 JSON request; its '
    'arrays hold a batch: rows first, as the model takes them), or data = "none"'
)


def _warm_up(runtime: Runtime, spec: WorkerSpec) -> None:
    try:
        inputs = warmup_inputs(runtime.inputs, spec.warmup)
    except WarmupInputError as exc:
        raise WarmupFailed(f"{exc}. {_WARMUP_HINT}") from None
    if inputs is None:
        return
    try:
        runtime.run(inputs, [o.name for o in runtime.outputs])
    except Exception as exc:
        detail = (str(exc).strip().splitlines() or [""])[0]
        raise WarmupFailed(
            f"the model failed on the gateway's warm-up input ({spec.warmup.describe()}), "
            f"not on a request: {type(exc).__name__}: {detail}. {_WARMUP_HINT}"
        ) from None


class _Arenas:
    """Arenas by name, mapped on first use; older ones are dropped when replaced."""

    def __init__(self) -> None:
        self._maps: dict[str, MappedArena] = {}

    def get(self, name: str, role: str) -> MappedArena:
        arena = self._maps.get(role)
        if arena is None or arena.name != name:
            if arena is not None:
                arena.close()
            arena = self._maps[role] = MappedArena(name)
        return arena


def _answer(runtime: Runtime, call: InferCall, arenas: _Arenas) -> InferDone:
    inp = arenas.get(call.in_arena, "in")
    inputs = {ref.name: read_tensor(inp.buf, ref, copy=False) for ref in call.inputs}
    outputs = runtime.run(inputs, list(call.outputs))
    del inputs  # views into the arena; drop them before it can be remapped
    needed = layout_size(outputs)
    if needed > call.out_capacity:
        inline = {name: to_wire(a) for name, a in outputs.items()}
        refs = tuple(
            TensorRef(name, v2_datatype(a.dtype), tuple(a.shape), 0, 0)
            for name, a in outputs.items()
        )
        return InferDone(call.id, refs, inline=inline, needed=needed)
    out = arenas.get(call.out_arena, "out")
    return InferDone(call.id, write_tensors(out.buf, outputs), needed=needed)


PROCESS_NAME = b"ig-worker"  # in ps and top; a worker's command line is the fork server's


def _watch(lifeline: Connection) -> None:
    """Exit as soon as the gateway is gone (its end of the lifeline closes when it dies,
    even by SIGKILL), whatever the worker is doing: a model call cannot be interrupted."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            lifeline.recv_bytes()
        os._exit(1)

    threading.Thread(target=watch, name="infergate-lifeline", daemon=True).start()


def worker_main(
    conn: Connection,
    spec: WorkerSpec,
    environ: dict[str, str] | None = None,
    lifeline: Connection | None = None,
) -> None:
    # Ctrl-C in the terminal reaches the whole process group; the gateway decides when
    # workers stop, so they ignore SIGINT and drain in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    procname.set_name(PROCESS_NAME)
    if lifeline is not None:
        _watch(lifeline)
    if environ is not None:  # the gateway's, as it was when this worker was started
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(dict(spec.env))  # before any runtime initialises CUDA
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpus)
    if spec.nice:
        os.nice(spec.nice)
    try:
        runtime = _load(spec)
    except Exception as exc:  # any load failure is reported, not raised: the gateway decides
        conn.send_bytes(encode(LoadFailed(f"{type(exc).__name__}: {exc}")))
        conn.close()
        return
    conn.send_bytes(
        encode(
            Ready(
                os.getpid(),
                runtime.device,
                runtime.inputs,
                runtime.outputs,
                os.environ.get("CUDA_VISIBLE_DEVICES"),
            )
        )
    )
    arenas = _Arenas()
    while True:
        try:
            message = decode(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the gateway went away
        if isinstance(message, Stop):
            return
        assert isinstance(message, InferCall)
        try:
            reply: InferDone | InferFailed = _answer(runtime, message, arenas)
        except Exception as exc:
            detail = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {detail[0] if detail else ''}"
            reply = InferFailed(message.id, reason, isinstance(exc, DataNotServable))
            if os.environ.get("INFERGATE_WORKER_TRACEBACKS"):
                traceback.print_exc()
        conn.send_bytes(encode(reply))
