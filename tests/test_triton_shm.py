"""Triton's system shared memory extension, as tritonclient.utils.shared_memory and Triton's
shm example use it; and CUDA shared memory on a host without a GPU."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from infergate.engine.admission.tenants import hash_key
from tests.conftest import write_profile
from tests.server import ServerProcess
from tests.triton_models import make_simple

BYTES = 16 * 4  # one row of 16 INT32


def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def mapped(server: ServerProcess, key: str) -> bool:
    """Whether the gateway process has the shm object `key` mapped now."""
    assert server.process is not None
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    return f"/dev/shm/{key.lstrip('/')}" in maps


@pytest.fixture
def regions(triton_server: ServerProcess) -> Iterator[tuple[object, object, str, str]]:
    tag = uuid.uuid4().hex[:8]
    in_key, out_key = f"/in_{tag}", f"/out_{tag}"
    inp = shm.create_shared_memory_region("input_data", in_key, BYTES * 2)
    out = shm.create_shared_memory_region("output_data", out_key, BYTES * 2)
    yield inp, out, in_key, out_key
    client(triton_server).unregister_system_shared_memory()
    shm.destroy_shared_memory_region(inp)
    shm.destroy_shared_memory_region(out)


def test_the_shm_example_round_trip(
    triton_server: ServerProcess, regions: tuple[object, object, str, str]
) -> None:
    c = client(triton_server)
    inp, out, in_key, out_key = regions
    c.unregister_system_shared_memory()
    c.unregister_cuda_shared_memory()  # Triton's example does this first, even without a GPU
    input0 = np.arange(16, dtype=np.int32)
    input1 = np.ones(16, dtype=np.int32)
    shm.set_shared_memory_region(inp, [input0])
    shm.set_shared_memory_region(inp, [input1], offset=BYTES)
    c.register_system_shared_memory("output_data", out_key, BYTES * 2)
    c.register_system_shared_memory("input_data", in_key, BYTES * 2)
    assert mapped(triton_server, in_key)
    assert mapped(triton_server, out_key)
    status = {r["name"]: r for r in c.get_system_shared_memory_status()}
    assert status["input_data"] == {
        "name": "input_data",
        "key": in_key,
        "offset": 0,
        "byte_size": BYTES * 2,
    }
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory("input_data", BYTES)
    inputs[1].set_shared_memory("input_data", BYTES, offset=BYTES)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory("output_data", BYTES)
    outputs[1].set_shared_memory("output_data", BYTES, offset=BYTES)
    result = c.infer("simple", inputs, outputs=outputs)
    out0 = result.get_output("OUTPUT0")
    assert out0["shape"] == [1, 16]
    total = shm.get_contents_as_numpy(out, np.int32, [1, 16])
    difference = shm.get_contents_as_numpy(out, np.int32, [1, 16], offset=BYTES)
    assert total.tolist() == [(input0 + input1).tolist()]
    assert difference.tolist() == [(input0 - input1).tolist()]
    c.unregister_system_shared_memory("input_data")
    assert not mapped(triton_server, in_key)  # closed on unregister
    assert [r["name"] for r in c.get_system_shared_memory_status()] == ["output_data"]


def test_json_outputs_with_shm_inputs(
    triton_server: ServerProcess, regions: tuple[object, object, str, str]
) -> None:
    c = client(triton_server)
    inp, _, in_key, _ = regions
    shm.set_shared_memory_region(inp, [np.full(32, 2, dtype=np.int32)])
    c.register_system_shared_memory("input_data", in_key, BYTES * 2)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory("input_data", BYTES)
    inputs[1].set_shared_memory("input_data", BYTES, offset=BYTES)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
    result = c.infer("simple", inputs, outputs=outputs)
    assert result.as_numpy("OUTPUT0").tolist() == [[4] * 16]


def _register(server: ServerProcess, region: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/systemsharedmemory/region/{region}/register", json=body, timeout=10
    )


def test_bad_registrations_are_400(
    triton_server: ServerProcess, regions: tuple[object, object, str, str]
) -> None:
    _, _, in_key, _ = regions
    cases = [
        ({"key": "/no_such_region_here", "offset": 0, "byte_size": 8}, "unable to open"),
        ({"key": in_key, "offset": 0, "byte_size": BYTES * 4}, "past the end"),
        ({"key": in_key, "offset": BYTES * 2, "byte_size": 1}, "past the end"),
        ({"key": "../etc/passwd", "offset": 0, "byte_size": 8}, "not a shared memory key"),
        ({"key": "/a/b", "offset": 0, "byte_size": 8}, "not a shared memory key"),
        ({"key": in_key, "offset": -1, "byte_size": 8}, "offset"),
    ]
    for body, message in cases:
        response = _register(triton_server, "bad", body)
        assert response.status_code == 400, body
        assert message in response.json()["error"], body
    assert client(triton_server).get_system_shared_memory_status() == []


def test_inference_naming_a_missing_region_or_past_its_end(
    triton_server: ServerProcess, regions: tuple[object, object, str, str]
) -> None:
    c = client(triton_server)
    _, _, in_key, _ = regions
    c.register_system_shared_memory("input_data", in_key, BYTES * 2)
    for region, offset, message in (
        ("missing", 0, "is not registered"),
        ("input_data", BYTES * 2 - 4, "past the end"),
    ):
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_shared_memory(region, BYTES, offset=offset)
        with pytest.raises(InferenceServerException) as caught:
            c.infer("simple", inputs)
        assert caught.value.status() == "400"
        assert message in caught.value.message()


def test_an_output_range_too_small_is_400(
    triton_server: ServerProcess, regions: tuple[object, object, str, str]
) -> None:
    c = client(triton_server)
    _, _, _, out_key = regions
    c.register_system_shared_memory("output_data", out_key, BYTES * 2)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    output = httpclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("output_data", BYTES - 1)
    with pytest.raises(InferenceServerException) as caught:
        c.infer("simple", inputs, outputs=[output])
    assert caught.value.status() == "400"
    assert "needs 64 bytes" in caught.value.message()


def test_cuda_shared_memory_without_a_gpu(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    assert c.get_cuda_shared_memory_status() == []
    c.unregister_cuda_shared_memory()  # nothing registered: nothing to do
    response = httpx.post(
        f"{triton_server.url}/v2/cudasharedmemory/region/r/register",
        json={"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 8},
    )
    assert response.status_code == 400
    devices = httpx.get(f"{triton_server.url}/admin/stats").json()["devices"]
    if any(d["kind"] == "gpu" for d in devices):
        assert "not supported by infergate yet" in response.json()["error"]
    else:
        assert "this host has no GPU" in response.json()["error"]


def test_a_region_is_mapped_only_as_large_as_registered(triton_server: ServerProcess) -> None:
    key = f"/big_{uuid.uuid4().hex[:8]}"
    big = shm.create_shared_memory_region("big", key, 2**20)
    try:
        client(triton_server).register_system_shared_memory("big", key, 100, offset=8)
        assert triton_server.process is not None
        maps = Path(f"/proc/{triton_server.process.pid}/maps").read_text().splitlines()
        (line,) = [m for m in maps if m.endswith(f"/dev/shm/{key[1:]}")]
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        assert end - start < 2**20  # one page for 108 bytes, not the whole megabyte
        client(triton_server).unregister_system_shared_memory("big")
    finally:
        shm.destroy_shared_memory_region(big)


def test_registering_needs_the_admin_key_when_the_profile_sets_one(tmp_path: Path) -> None:
    """Registering makes the gateway map memory a client names: not for any tenant."""
    models = tmp_path / "models"
    make_simple(models / "simple" / "1" / "model.onnx")
    profile = write_profile(tmp_path, f'[server]\nadmin_keys = ["{hash_key("admin")}"]\n')
    server = ServerProcess(models, profile, tmp_path / "server.log").start()
    key = f"/guarded_{uuid.uuid4().hex[:8]}"
    region = shm.create_shared_memory_region("guarded", key, 64)
    try:
        url = f"{server.url}/v2/systemsharedmemory/region/guarded/register"
        body = {"key": key, "offset": 0, "byte_size": 64}
        assert httpx.post(url, json=body).status_code == 401
        admin = {"Authorization": "Bearer admin"}
        assert httpx.post(url, json=body, headers=admin).status_code == 200
        status = httpx.get(f"{server.url}/v2/systemsharedmemory/status", headers=admin)
        assert [r["name"] for r in status.json()] == ["guarded"]
    finally:
        server.stop()
        shm.destroy_shared_memory_region(region)
