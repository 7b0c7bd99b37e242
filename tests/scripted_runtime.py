"""A runtime for tests whose behaviour is set by its input, never by how fast the CPU is.

Registered only where INFERGATE_RUNTIME_PLUGINS names this module (tests/conftest.py sets
it, so servers the tests start and their workers see it). A model is a `model.scripted`
TOML file (write one with `make_scripted`):

    gate_dir = "/tmp/gates"     # where `hold` waits for its release file
    load_ms = 0                 # sleep while loading
    load_alloc_mb = 0           # allocate (and keep) this much while loading
    load_fail = ""              # a message: loading fails with it
    mark_loads = false          # hold `gate_dir/loading-<pid>` while loading
    reject_zeros = false        # a batch whose `x` is all zeros fails (as warm-up sends)
    [[inputs]] / [[outputs]]    # name, datatype, shape, as in model.toml

Inputs with these names steer each batch (the largest value in the batch counts):
`sleep_ms` sleeps that long; `fail` != 0 raises; `crash` != 0 ends the worker process;
`alloc_mb` allocates and touches that much for the call (`keep_mb`: for good), first;
`hold` = N writes `gate_dir/holding-N-<pid>` (so a test can see which worker holds it;
`holding`) and waits until the file `gate_dir/release-N` exists. While the file
`gate_dir/hold-loads` exists, loading (a restart's too) waits for it to go. Outputs: `y` is `x`
unchanged, `pid` the worker's pid per row, `rows` the rows in the batch per row, and
any other output is zeros of its declared shape (free dimensions: the batch's rows).
"""

from __future__ import annotations

import mmap
import os
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tomlkit

from infergate.engine.repository.spec import TensorSpec
from infergate.engine.runtimes import RuntimeKind, register
from infergate.tensors import Array, numpy_dtype

PLUGIN = "tests.scripted_runtime"
_kept: list[Array] = []  # keep_mb allocations live as long as the worker


def _specs(rows: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(r["name"], r["datatype"], tuple(r["shape"])) for r in rows)


def _largest(inputs: dict[str, Array], name: str) -> int:
    value = inputs.get(name)
    return int(np.max(value)) if value is not None and value.size else 0


def _touch(mb: int) -> Array:
    """`mb` of memory, every page resident (in the worker's RSS, which the memory monitor
    reads) for as long as the array lives. Mapped with MAP_POPULATE, which makes the pages
    resident in one system call: written one page at a time (np.ones), a fault each, 400
    MB took 3 to 4 s of system CPU on the 2-core VM the suite runs on, 0.2 s this way."""
    size = mb * 2**20
    if size <= 0:  # (mmap takes no empty mapping)
        return np.ones(0, dtype=np.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    memory = np.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=np.uint8)
    memory.fill(1)  # ones, so every page is really resident wherever MAP_POPULATE is not
    return memory


def wait_while(holding: Callable[[], bool]) -> None:
    """Look often at first, then every 20 ms: a test may hold many workers for seconds."""
    pause = 0.001
    while holding():
        time.sleep(pause)
        pause = min(pause * 1.5, 0.02)


class ScriptedRuntime:
    def __init__(self, path: Path) -> None:
        script = tomllib.loads(path.read_text())
        self._inputs = _specs(script.get("inputs", []))
        self._outputs = _specs(script.get("outputs", []))
        self._gates = Path(script.get("gate_dir", path.parent))
        self._reject_zeros = bool(script.get("reject_zeros", False))
        marker = self._gates / f"loading-{os.getpid()}"
        if script.get("mark_loads"):  # a test counts the loads under way
            self._gates.mkdir(parents=True, exist_ok=True)
            marker.touch()
        try:
            wait_while(lambda: (self._gates / "hold-loads").exists())  # a restart waits
            if script.get("load_fail"):
                raise RuntimeError(script["load_fail"])
            if script.get("load_alloc_mb"):
                _kept.append(_touch(int(script["load_alloc_mb"])))
            time.sleep(float(script.get("load_ms", 0)) / 1000)
        finally:
            marker.unlink(missing_ok=True)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    @property
    def device(self) -> str:
        return "cpu"

    def run(self, inputs: dict[str, Array], output_names: list[str]) -> dict[str, Array]:
        rows = next(iter(inputs.values())).shape[0] if inputs else 1
        if self._reject_zeros and "x" in inputs and not np.any(inputs["x"]):
            raise ValueError("scripted model: x is all zeros, which this model rejects")
        if _largest(inputs, "crash"):
            os._exit(3)
        held = _touch(_largest(inputs, "alloc_mb")) if _largest(inputs, "alloc_mb") else None
        if _largest(inputs, "keep_mb"):
            _kept.append(_touch(_largest(inputs, "keep_mb")))
        gate = _largest(inputs, "hold")  # after allocating: a held call holds its memory
        if gate:
            release = self._gates / f"release-{gate}"
            self._gates.mkdir(parents=True, exist_ok=True)
            (self._gates / f"holding-{gate}-{os.getpid()}").touch()
            wait_while(lambda: not release.exists())  # the worker polls; the test never sleeps
        time.sleep(_largest(inputs, "sleep_ms") / 1000)
        del held
        if _largest(inputs, "fail"):
            raise RuntimeError("scripted failure (the request's `fail` input asked for it)")
        out: dict[str, Array] = {}
        for spec in self._outputs:
            if spec.name not in output_names:
                continue
            if spec.name == "y" and "x" in inputs:
                out["y"] = np.array(inputs["x"], copy=True)
            elif spec.name == "pid":
                out["pid"] = np.full((rows, 1), os.getpid(), dtype=np.int64)
            elif spec.name == "rows":
                out["rows"] = np.full((rows, 1), rows, dtype=np.int64)
            else:
                shape = tuple(rows if d < 0 else d for d in spec.shape)
                out[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.datatype))
        return out


def open_scripted(
    path: Path,
    device: str,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    threads: int | None,
    memory_mb: int | None,
) -> ScriptedRuntime:
    return ScriptedRuntime(path)


register(
    RuntimeKind(
        "scripted",
        (".scripted",),
        "infergate_scripted",
        "numpy",
        "it is the test suite's runtime: set INFERGATE_RUNTIME_PLUGINS=tests.scripted_runtime",
        f"{PLUGIN}:open_scripted",
    )
)

CONTROLS = ("sleep_ms", "fail", "crash", "alloc_mb", "keep_mb", "hold")


def make_scripted(
    path: Path,
    controls: tuple[str, ...] = ("sleep_ms",),
    width: int = 4,
    gate_dir: Path | None = None,
    outputs: tuple[str, ...] = ("y", "pid", "rows"),
    extra_inputs: tuple[tuple[str, str, list[int]], ...] = (),
    **settings: object,
) -> Path:
    """Write a scripted model: `x` FP32 [-1, width] plus the control inputs named (each
    INT64 [-1, 1]), answering `outputs`. `settings` are the file's top-level keys."""
    unknown = set(controls) - set(CONTROLS)
    if unknown:
        raise ValueError(f"unknown controls {sorted(unknown)}; known: {CONTROLS}")
    shapes = {"y": ("FP32", [-1, width]), "pid": ("INT64", [-1, 1]), "rows": ("INT64", [-1, 1])}
    script: dict[str, object] = dict(settings)
    if gate_dir is not None:
        script["gate_dir"] = str(gate_dir)
    ins = [("x", "FP32", [-1, width]), *[(c, "INT64", [-1, 1]) for c in controls]]
    ins += list(extra_inputs)
    script["inputs"] = [{"name": n, "datatype": d, "shape": s} for n, d, s in ins]
    script["outputs"] = [
        {"name": o, "datatype": shapes[o][0], "shape": shapes[o][1]} for o in outputs
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomlkit.dumps(script))
    return path


def holding(gate_dir: Path, gate: int) -> list[int]:
    """The pids of the workers that have held a call at gate `gate`, oldest first."""
    marks = sorted(gate_dir.glob(f"holding-{gate}-*"), key=lambda p: p.stat().st_mtime_ns)
    return [int(p.name.rsplit("-", 1)[1]) for p in marks]


def scripted_inputs(rows: int = 1, width: int = 4, **controls: int) -> dict[str, Any]:
    """A V2 JSON request body for a scripted model: `x` of `rows` rows and each control
    set to its value on every row."""
    inputs = [
        {
            "name": "x",
            "datatype": "FP32",
            "shape": [rows, width],
            "data": [float(i) for i in range(rows * width)],
        }
    ]
    for name, value in controls.items():
        inputs.append(
            {"name": name, "datatype": "INT64", "shape": [rows, 1], "data": [value] * rows}
        )
    return {"inputs": inputs}
