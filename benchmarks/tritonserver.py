"""NVIDIA Triton as a peer for the benchmarks: find the server that the nvidia-pytriton wheel
ships (or a Triton folder such as a container's /opt/tritonserver), lay out its Python
backend, write a model repository whose models run an ONNX file in onnxruntime, and run the
server on a free loopback port.

Triton's own ONNX backend is not in the wheel; its Python backend is, so each model is a
`model.py` that runs onnxruntime on the rows of a whole batch of requests at once.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.server import wait_ready

INSTALL_HINT = (
    "Hint: ./install.sh --bench installs it: the bench extra's nvidia-pytriton wheel, which "
    "ships Triton's server, without the wheel's Python dependencies (pip install -e "
    "'.[bench]' installs those too, numpy<2 among them). Or give --triton-home a Triton "
    "folder such as a container's /opt/tritonserver"
)
STUB = "triton_python_backend_stub"
# What the Python backend's folder holds besides the stub (the stub comes per Python).
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


class TritonMissing(Exception):
    """Triton's server, its Python backend or its stub for this Python is not there."""


@dataclass(frozen=True)
class TritonInstall:
    server: Path  # bin/tritonserver
    python_backend: Path  # the folder holding BACKEND_FILES
    stub: Path  # the Python backend's stub, built for this interpreter's version
    libs: Path | None  # shared libraries the server and the stub load (LD_LIBRARY_PATH)


def find_triton(home: Path | None = None) -> TritonInstall:
    """The Triton in `home`, else the one in the nvidia-pytriton wheel (found without
    importing pytriton: its package pulls in dependencies the benchmark does not need)."""
    libs: Path | None
    if home is None:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonMissing(f"NVIDIA Triton is not installed. {INSTALL_HINT}")
        package = Path(next(iter(spec.submodule_search_locations)))
        home = package / "tritonserver"
        libs = package.parent / "nvidia_pytriton.libs"  # where the wheel's RPATH points
    else:
        libs = home / "lib"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = home / "python_backend_stubs" / version / STUB  # the wheel: one per Python
    if not stub.exists():
        stub = home / "backends" / "python" / STUB  # a container: built for its Python
    install = TritonInstall(
        home / "bin" / "tritonserver",
        home / "backends" / "python",
        stub,
        libs if libs.is_dir() else None,
    )
    for needed in (install.server, stub, *(install.python_backend / f for f in BACKEND_FILES)):
        if not needed.exists():
            raise TritonMissing(
                f"NVIDIA Triton is not complete in {home}: {needed} is missing"
                + (f" (the stub must be built for Python {version})" if needed == stub else "")
                + f". {INSTALL_HINT}"
            )
    return install


def write_backends(install: TritonInstall, folder: Path) -> Path:
    """`folder`/backends/python with the backend's files and this Python's stub, for
    --backend-directory (the wheel keeps its stubs apart, one per Python version)."""
    python = folder / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    for name in BACKEND_FILES:
        shutil.copy2(install.python_backend / name, python / name)
    shutil.copy2(install.stub, python / STUB)
    return folder / "backends"


def site_packages() -> list[str]:
    """This interpreter's package folders (the virtual environment's, when in one)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def config_pbtxt(
    name: str,
    width: int,
    out: int,
    max_batch_size: int,
    queue_delay_us: int | None,
    instances: int,
) -> str:
    """An MLP's model configuration: x [width] -> y [out], FP32, batched; the dynamic
    batcher with `queue_delay_us` of delay, or none when it is None."""
    batcher = (
        ""
        if queue_delay_us is None
        else f"dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}\n"
    )
    return (
        f'name: "{name}"\n'
        'backend: "python"\n'
        f"max_batch_size: {max_batch_size}\n"
        f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {width} ] }} ]\n'
        f'output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {out} ] }} ]\n'
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n" + batcher
    )


MODEL_PY = '''"""Written by infergate's benchmarks/tritonserver.py: runs model.onnx beside this file
in onnxruntime (one intra-op thread) on the rows of a whole batch of requests at once."""

import sys

# The stub runs its own Python, which does not see the virtual environment.
sys.path[:0] = {paths!r}

import os  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


def _quiet_consumed_capsules(unraisable, default=sys.unraisablehook):
    # The stub renames a DLPack capsule it consumed "used_dlpack" (the DLPack spec says
    # "used_dltensor") and frees the tensor itself; NumPy's capsule deleter then reports
    # the name, once per response, on stderr. Nothing leaks: drop only that report.
    if unraisable.object is None and "PyCapsule_GetPointer called with incorrect name" in str(
        unraisable.exc_value
    ):
        return
    default(unraisable)


sys.unraisablehook = _quiet_consumed_capsules


class TritonPythonModel:
    def initialize(self, args):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.onnx")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        # Tensors cross by DLPack: the stub's pybind11 predates NumPy 2 and misreads its
        # dtypes' sizes, which as_numpy() and Tensor(name, array) rely on.
        rows = [np.from_dlpack(pb_utils.get_input_tensor_by_name(r, "x")) for r in requests]
        (y,) = self.session.run(["y"], {{"x": np.concatenate(rows)}})
        responses, start = [], 0
        for x in rows:
            end = start + len(x)
            out = pb_utils.Tensor.from_dlpack("y", y[start:end])
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start = end
        return responses
'''


def model_py(paths: list[str]) -> str:
    return MODEL_PY.format(paths=paths)


def write_model(repository: Path, name: str, onnx: Path, config: str, source: str) -> Path:
    """`repository`/name: config.pbtxt, and version 1 with model.py beside a link to the
    ONNX file (the very file the other servers serve)."""
    version = repository / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    (repository / name / "config.pbtxt").write_text(config)
    (version / "model.py").write_text(source)
    (version / "model.onnx").symlink_to(onnx.resolve())
    return repository / name


def command(install: TritonInstall, repository: Path, backends: Path, port: int) -> list[str]:
    """HTTP on loopback only; no gRPC, no metrics; warnings and errors only in the log."""
    return [
        str(install.server),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        "--model-control-mode=none",
        "--disable-auto-complete-config",
        "--allow-http=true",
        "--http-address=127.0.0.1",
        f"--http-port={port}",
        "--allow-grpc=false",
        "--allow-metrics=false",
        "--log-verbose=0",
        "--log-info=false",
        "--exit-on-error=true",
    ]


class TritonProcess:
    """tritonserver in its own process group, its output in `log`."""

    def __init__(self, install: TritonInstall, repository: Path, backends: Path, log: Path):
        self.install = install
        self.repository = repository
        self.backends = backends
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, port: int, timeout_s: float = 180.0) -> TritonProcess:
        env = dict(os.environ)
        if self.install.libs is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(self.install.libs), env.get("LD_LIBRARY_PATH", "")) if p
            )
        self.url = f"http://127.0.0.1:{port}"
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command(self.install, self.repository, self.backends, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its stubs go with it when the group is killed
            )
        try:
            wait_ready(self.url, self.process, self.log, timeout_s)
        except RuntimeError:
            self.stop()
            raise
        return self

    def version(self) -> str:
        return str(httpx.get(f"{self.url}/v2", timeout=5).json().get("version", "?"))

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
