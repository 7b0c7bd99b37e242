"""What a process pays on this host for going to sleep between requests.

    .venv/bin/python benchmarks/wake_cost.py [--calls N] [--json]

A lone client's request wakes three sleeping processes in turn (the gateway, a worker,
the gateway again, then the client), and at concurrency 64 each batch wakes a worker. On
a virtual machine each of those costs more than the code that runs: the sleep and the
wake-up themselves, and the caches the process finds cold (the core ran something else,
or the host ran another guest's vCPU on it). This prices both with no server: the CPU
time (CLOCK_PROCESS_CPUTIME_ID, exact) of a bare `time.sleep` of 0.3 and 2 ms, and of one
worker call (`engine/workers/worker.py`'s decode, run on the tiny MLP's onnxruntime
session, encode: what a worker does per batch, the pipe left out) made back to back, and
made after each such sleep, minus the sleep's own cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from http_cpu import tiny_setup  # noqa: E402

from infergate.engine.runtimes.onnx import OnnxRuntime  # noqa: E402
from infergate.engine.workers import worker  # noqa: E402
from infergate.engine.workers.messages import InferCall, decode, encode  # noqa: E402
from infergate.engine.workers.shm import OwnedArena, write_tensors  # noqa: E402


def cpu_per_call(work: Callable[[], object], calls: int, pause_s: float) -> float:
    """Process CPU µs per `work()`, each followed by a sleep of `pause_s` (0: none)."""
    started = time.process_time()
    for _ in range(calls):
        work()
        if pause_s:
            time.sleep(pause_s)
    return (time.process_time() - started) / calls * 1e6


def worker_call(folder: Path, owned: list[OwnedArena]) -> Callable[[], bytes]:
    """One worker call on the tiny model, as the worker makes it (its pipe left out);
    the arenas it made go in `owned`, for the caller to close."""
    import numpy as np

    models, *_ = tiny_setup(folder)
    runtime = OnnxRuntime(models / "tiny" / "1" / "model.onnx", "cpu", 1)
    names = tuple(spec.name for spec in runtime.outputs)
    arenas_in, arenas_out = OwnedArena(1 << 16), OwnedArena(1 << 16)
    owned += (arenas_in, arenas_out)
    refs = write_tensors(arenas_in.buf, {"x": np.ones((1, 64), np.float32)})
    raw = encode(InferCall(1, arenas_in.name, arenas_out.name, arenas_out.size, refs, names))
    arenas = worker._Arenas()

    def call() -> bytes:
        message = decode(raw)
        assert isinstance(message, InferCall)
        return encode(worker._answer(runtime, message, arenas))

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="per figure")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    owned: list[OwnedArena] = []
    try:
        call = worker_call(Path(tempfile.mkdtemp(prefix="infergate-wake-")), owned)
        cpu_per_call(call, 500, 0.0)  # warm
        figures = {"call, back to back": cpu_per_call(call, args.calls * 5, 0.0)}
        for pause in (0.0003, 0.002):
            sleep = cpu_per_call(lambda: None, args.calls, pause)
            figures[f"sleep {pause * 1e3:g} ms"] = sleep
            figures[f"call after a {pause * 1e3:g} ms sleep"] = (
                cpu_per_call(call, args.calls, pause) - sleep
            )
    finally:
        for arena in owned:
            arena.close()
    if args.json:
        print(json.dumps(figures))
        return
    print("CPU µs (this process's, exact) per:")
    for name, value in figures.items():
        print(f"  {name:28s} {value:7.1f}")


if __name__ == "__main__":
    main()
