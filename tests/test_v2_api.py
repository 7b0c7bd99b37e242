"""The KServe V2 API against a real server: httpx, curl-shaped JSON, and tritonclient."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import REPO, write_profile
from tests.onnx_models import ECHO_TYPES
from tests.server import ServerProcess


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(path)).run(None, feeds)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def triton_client(server: ServerProcess) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


def test_health_and_server_metadata(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    meta = httpx.get(f"{server.url}/v2").json()
    assert meta["name"] == "triton"  # as Triton's examples check ([server] server_name)
    assert "binary_tensor_data" in meta["extensions"]


def test_model_metadata_reads_the_graph(server: ServerProcess) -> None:
    meta = httpx.get(f"{server.url}/v2/models/mlp").json()
    assert meta["name"] == "mlp"
    assert meta["versions"] == ["1", "2"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]
    v1 = httpx.get(f"{server.url}/v2/models/mlp/versions/1")
    assert v1.status_code == 200
    assert httpx.get(f"{server.url}/v2/models/mlp/versions/2/ready").status_code == 200


def test_json_infer_equals_onnxruntime_and_echoes_id(
    server: ServerProcess, repository: Path
) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 7
    body = {
        "id": "req-42",
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": x.reshape(-1).tolist()}
        ],
    }
    response = httpx.post(f"{server.url}/v2/models/mlp/versions/1/infer", json=body)
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["id"] == "req-42"
    assert doc["model_name"] == "mlp"
    assert doc["model_version"] == "1"
    [out] = doc["outputs"]
    assert out["name"] == "y"
    assert out["shape"] == [2, 3]
    expected = ort_run(repository / "mlp" / "1" / "model.onnx", {"x": x})[0]
    np.testing.assert_allclose(np.array(out["data"]).reshape(2, 3), expected, rtol=1e-6)


def test_default_version_is_the_highest(server: ServerProcess) -> None:
    x = np.zeros((1, 4), np.float32)
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x.tolist()}]
    }  # nested data is accepted too
    doc = httpx.post(f"{server.url}/v2/models/mlp/infer", json=body).json()
    assert doc["model_version"] == "2"
    assert min(doc["outputs"][0]["data"]) > 50  # version 2 adds 100


def test_binary_request_and_response(server: ServerProcess, repository: Path) -> None:
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [5, 4],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    )
    response = httpx.post(
        f"{server.url}/v2/models/lone/infer",
        content=header + x.tobytes(),
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert response.status_code == 200, response.text
    json_len = int(response.headers["Inference-Header-Content-Length"])
    doc = orjson.loads(response.content[:json_len])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 5 * 3 * 4
    y = np.frombuffer(response.content[json_len:], dtype=np.float32).reshape(5, 3)
    np.testing.assert_allclose(y, ort_run(repository / "lone.onnx", {"x": x})[0], rtol=1e-6)


def _echo_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray] = {}
    for name in ECHO_TYPES:
        if name == "BYTES":
            out[name] = np.array([[b"hello", b""], [b"\xc3\xa9t\xc3\xa9", b"x" * 50]], dtype=object)
        elif name == "BOOL":
            out[name] = np.array([[True, False], [False, True]])
        else:
            from infergate.tensors import numpy_dtype

            dtype = numpy_dtype(name)
            out[name] = (rng.integers(0, 100, (2, 2)) * (1 if dtype.kind != "f" else 0.5)).astype(
                dtype
            )
    return out


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_every_datatype(
    triton_client: triton.InferenceServerClient, binary: bool
) -> None:
    values = _echo_inputs()
    inputs = []
    for name, array in values.items():
        tensor = triton.InferInput(f"in_{name}", list(array.shape), name)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    outputs = [triton.InferRequestedOutput(f"out_{n}", binary_data=binary) for n in values]
    result = triton_client.infer("echo", inputs, outputs=outputs, request_id="t1")
    assert result.get_response()["id"] == "t1"
    for name, array in values.items():
        got = result.as_numpy(f"out_{name}")
        assert got is not None, name
        if name == "BYTES":
            # tritonclient hands JSON BYTES back as str, binary ones as bytes.
            as_bytes = [b.encode() if isinstance(b, str) else bytes(b) for b in got.reshape(-1)]
            assert as_bytes == list(array.reshape(-1))
        else:
            assert got.dtype == array.dtype, name
            np.testing.assert_array_equal(got, array)


def test_tritonclient_defaults_and_repository_index(
    triton_client: triton.InferenceServerClient, repository: Path
) -> None:
    assert triton_client.is_server_live()
    assert triton_client.is_server_ready()
    assert triton_client.is_model_ready("mlp")
    assert triton_client.is_model_ready("mlp", "1")
    assert not triton_client.is_model_ready("broken")
    meta = triton_client.get_model_metadata("digits")
    assert [i["name"] for i in meta["inputs"]] == ["input"]
    sample = np.load(Path(__file__).parent.parent / "examples" / "digit-7.npy")[np.newaxis]
    tensor = triton.InferInput("input", [1, 64], "FP32")
    tensor.set_data_from_numpy(sample)  # binary by default
    result = triton_client.infer("digits", [tensor])  # every output, binary by default
    assert result.as_numpy("label").tolist() == [7]
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (1, 10)
    np.testing.assert_allclose(
        probabilities,
        ort_run(repository / "digits" / "1" / "model.onnx", {"input": sample})[1],
        rtol=1e-6,
    )
    index = {(m["name"], m.get("version")): m for m in triton_client.get_model_repository_index()}
    assert index[("mlp", "1")]["state"] == "READY"
    assert index[("broken", "1")]["state"] == "UNAVAILABLE"  # Triton's word for it
    assert "load failed" in index[("broken", "1")]["reason"]


def test_tritonclient_sees_errors(triton_client: triton.InferenceServerClient) -> None:
    tensor = triton.InferInput("x", [1, 5], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 5), np.float32))
    with pytest.raises(InferenceServerException, match=r"shape \[1, 5\].*\[-1, 4\]"):
        triton_client.infer("mlp", [tensor])


def test_requested_outputs_only(server: ServerProcess) -> None:
    sample = np.zeros(64, np.float32).tolist()
    body = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": sample}],
        "outputs": [{"name": "label"}],
    }
    doc = httpx.post(f"{server.url}/v2/models/digits/infer", json=body).json()
    assert [o["name"] for o in doc["outputs"]] == ["label"]


@pytest.fixture
def encoder_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """The TorchScript example alone: the shared server leaves it out (its worker costs as
    much CPU as the rest of that server)."""
    shutil.copytree(REPO / "models" / "encoder", tmp_path / "models" / "encoder")
    proc = ServerProcess(tmp_path / "models", write_profile(tmp_path), tmp_path / "server.log")
    yield proc.start()
    proc.stop()


def test_torchscript_model_is_served(encoder_server: ServerProcess) -> None:
    import torch

    server = encoder_server

    features = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    body = {
        "inputs": [
            {
                "name": "features",
                "datatype": "FP32",
                "shape": [2, 8],
                "data": features.reshape(-1).tolist(),
            }
        ]
    }
    response = httpx.post(f"{server.url}/v2/models/encoder/infer", json=body)
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    assert out["name"] == "embedding"
    got = np.array(out["data"], np.float32).reshape(out["shape"])
    model_pt = REPO / "models/encoder/1/model.pt"
    module = torch.jit.load(str(model_pt))  # type: ignore[no-untyped-call]  # torch's own
    np.testing.assert_allclose(got, module(torch.from_numpy(features)).detach().numpy(), rtol=1e-5)
    meta = httpx.get(f"{server.url}/v2/models/encoder").json()
    assert meta["platform"] == "pytorch_libtorch"


def test_broken_model_is_reported_and_others_serve(server: ServerProcess) -> None:
    model = server.model("broken")
    assert model["state"] == "failed"
    assert "load failed" in model["reason"]
    response = httpx.post(f"{server.url}/v2/models/broken/infer", json={"inputs": []})
    assert response.status_code == 424  # no retry fixes it: a 4xx without Retry-After
    assert "retry-after" not in response.headers
    assert "broken" in response.json()["error"]
    assert httpx.get(f"{server.url}/v2/models/broken/ready").status_code == 424
