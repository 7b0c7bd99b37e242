"""benchmarks/triton_peer.py without Triton: the model repository it writes for Triton (each
config.pbtxt read with Triton's own schema, model.py run by a bare interpreter with a
stand-in for the stub's module), the same settings on both servers, and the clear exit 2
when Triton is not installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient
from google.protobuf import text_format  # type: ignore[import-untyped]  # protobuf ships no types

from benchmarks import tritonserver
from benchmarks.triton_peer import (
    BIG_QUICK,
    DELAY_MS,
    MAX_BATCH,
    TINY,
    log_tail,
    write_models,
)
from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "triton_peer.py"
# What the Python backend's stub lets a model.py import: only what model.py uses.
FAKE_PB_UTILS = '''"""A stand-in for triton_python_backend_utils, which Triton's stub provides."""
import numpy as np


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.ascontiguousarray(array)

    @classmethod
    def from_dlpack(cls, name, producer):
        return cls(name, np.from_dlpack(producer).copy())

    def name(self):
        return self._name

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class InferenceRequest:
    def __init__(self, inputs):
        self.inputs = inputs


class InferenceResponse:
    def __init__(self, output_tensors):
        self.output_tensors = output_tensors


def get_input_tensor_by_name(request, name):
    return next((t for t in request.inputs if t.name() == name), None)
'''
DRIVER = """
import json, runpy, sys
sys.path.insert(0, sys.argv[2])
model = runpy.run_path(sys.argv[1])["TritonPythonModel"]()
import numpy as np
import triton_python_backend_utils as pb
model.initialize({})
x = np.arange(3 * 64, dtype=np.float32).reshape(3, 64) / 100
requests = [pb.InferenceRequest([pb.Tensor("x", rows)]) for rows in (x[:1], x[1:])]
print(json.dumps([np.from_dlpack(r.output_tensors[0]).tolist() for r in model.execute(requests)]))
"""


def model_config_schema() -> ModuleType:
    """Triton's ModelConfig message, from tritonclient: the tritonclient.grpc package will
    not import without grpcio, but its model_config_pb2 needs only protobuf."""
    path = Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_config(path: Path) -> Any:
    schema = model_config_schema()
    return text_format.Parse(path.read_text(), schema.ModelConfig())


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_models(tmp_path_factory.mktemp("peer"), BIG_QUICK, instances=2)


def test_configs_are_triton_model_configs_with_the_same_batching(
    written: tuple[Path, Path],
) -> None:
    models, repository = written
    delays = {}
    for name in ("tiny", "tiny_direct", "big"):
        config = read_config(repository / name / "config.pbtxt")
        assert config.name == name
        assert config.backend == "python"
        assert config.max_batch_size == MAX_BATCH
        [group] = config.instance_group
        assert group.count == 2
        sizes = BIG_QUICK if name == "big" else TINY
        assert [(t.name, list(t.dims)) for t in config.input] == [("x", [sizes[0]])]
        assert [(t.name, list(t.dims)) for t in config.output] == [("y", [sizes[-1]])]
        delays[name] = (
            config.dynamic_batching.max_queue_delay_microseconds
            if config.HasField("dynamic_batching")
            else None
        )
    # The c=1 copy has no dynamic batcher: it would hold a lone request for its delay.
    assert delays == {"tiny": DELAY_MS * 1000, "tiny_direct": None, "big": DELAY_MS * 1000}
    for name in ("tiny", "big"):  # infergate serves the very same file, batched the same
        ours = tomllib.loads((models / name / "model.toml").read_text())
        assert ours == {
            "instances": 2,
            "threads": 1,
            "batching": {"max_batch_size": MAX_BATCH, "max_queue_delay_ms": DELAY_MS},
        }
        theirs = repository / name / "1" / "model.onnx"
        assert theirs.resolve() == (models / name / "1" / "model.onnx").resolve()
    tiny = (models / "tiny" / "1" / "model.onnx").resolve()
    assert (repository / "tiny_direct" / "1" / "model.onnx").resolve() == tiny


def test_model_py_runs_in_a_bare_interpreter(written: tuple[Path, Path], tmp_path: Path) -> None:
    """The stub runs its own Python, outside the virtual environment: model.py must find
    numpy and onnxruntime by the path it was written with, and answer each request with
    its own rows of the batch it ran."""
    _, repository = written
    source = (repository / "tiny" / "1" / "model.py").read_text()
    compile(source, "model.py", "exec")
    packages = tritonserver.site_packages()
    assert repr(packages) in source
    assert all(Path(p).is_dir() and Path(p).is_relative_to(sys.prefix) for p in packages)
    # The interpreter the virtual environment was made from; -I -S: no site-packages, no
    # PYTHONPATH, as the stub's own Python sees nothing of the virtual environment.
    bare = [str(getattr(sys, "_base_executable", sys.executable)), "-I", "-S"]
    without = subprocess.run([*bare, "-c", "import numpy"], capture_output=True, check=False)
    assert without.returncode != 0  # so what follows finds numpy by model.py's path alone
    (tmp_path / "triton_python_backend_utils.py").write_text(FAKE_PB_UTILS)
    done = subprocess.run(
        [*bare, "-c", DRIVER, str(repository / "tiny" / "1" / "model.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    first, rest = json.loads(done.stdout)
    x = np.arange(3 * 64, dtype=np.float32).reshape(3, 64) / 100
    session = ort.InferenceSession(str(repository / "tiny" / "1" / "model.onnx"))
    [expected] = session.run(["y"], {"x": x})
    assert np.allclose(first, expected[:1], atol=1e-5)
    assert np.allclose(rest, expected[1:], atol=1e-5)


def _run_script(prelude: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = (
        f"import runpy, sys\n{prelude}\n"
        f"sys.argv = [{str(SCRIPT)!r}, *{list(args)!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )


def test_without_triton_it_says_how_to_install_it_and_exits_2() -> None:
    # sys.modules[name] = None is how Python marks a package as not importable.
    done = _run_script("sys.modules['pytriton'] = None", "--quick")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "NVIDIA Triton is not installed" in done.stderr
    assert "pip install -e '.[bench]'" in done.stderr
    assert "./install.sh --bench" in done.stderr


def test_an_incomplete_triton_home_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tritonserver").write_text("")
    done = _run_script("", "--quick", "--triton-home", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"NVIDIA Triton is not complete in {tmp_path}" in done.stderr
    assert "triton_python_backend_stub is missing" in done.stderr
    assert "./install.sh --bench" in done.stderr


def test_a_failed_run_can_show_the_end_of_each_servers_log(tmp_path: Path) -> None:
    """When a server stops answering mid-run, the error carries the last lines of its
    log (`log_tail`), or says the log could not be read."""
    log = tmp_path / "triton.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "E1203 stub crashed\n")
    shown = log_tail(log, lines=3)
    assert shown.splitlines() == ["line 98", "line 99", "E1203 stub crashed"]
    assert "unreadable" in log_tail(tmp_path / "missing.log")
