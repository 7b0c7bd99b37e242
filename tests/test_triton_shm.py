"""Triton's system shared memory extension, as tritonclient.utils.shared_memory and Triton's
shm example use it; and CUDA shared memory on a host without a GPU."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from infergate.engine.admission.tenants import hash_key
from infergate.engine.triton.shared_memory import MAX_REGIONS, SharedMemoryRegions
from infergate.errors import BadRequest
from tests.conftest import write_profile
from tests.server import ServerProcess
from tests.triton_models import make_simple

BYTES = 16 * 4  # one row of 16 INT32
SHM = Path("/dev/shm")
DEEP = "[" * 1000 + "1" + "]" * 1000  # JSON that orjson reads, and whose repr recurses


def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def held(server: ServerProcess, key: str) -> bool:
    """Whether the gateway process holds the shm object `key` open now."""
    assert server.process is not None
    target = str(SHM / key.lstrip("/"))
    fds = Path(f"/proc/{server.process.pid}/fd")
    return any(os.readlink(fd) == target for fd in fds.iterdir() if fd.is_symlink())


def mapped(server: ServerProcess, key: str) -> bool:
    """Whether the gateway process has the shm object `key` mapped now."""
    assert server.process is not None
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    return str(SHM / key.lstrip("/")) in maps


def alive(server: ServerProcess) -> bool:
    assert server.process is not None
    ready = httpx.get(f"{server.url}/v2/health/ready", timeout=10)
    return server.process.poll() is None and ready.status_code == 200


def shm_file(prefix: str, data: bytes) -> tuple[str, Path]:
    """A shm object of the test's own, written without mapping it: the tests below shrink
    these, and a mapping of the test's would take SIGBUS in its turn."""
    key = f"/{prefix}_{uuid.uuid4().hex[:8]}"
    path = SHM / key[1:]
    path.write_bytes(data)
    return key, path


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
    assert held(triton_server, in_key)
    assert held(triton_server, out_key)
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
    assert not held(triton_server, in_key)  # closed on unregister
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
        ({"key": f"/link_{in_key[1:]}", "offset": 0, "byte_size": 8}, "unable to open"),
    ]
    link = SHM / f"link_{in_key[1:]}"
    link.symlink_to(SHM / in_key[1:])  # shm_open follows no link: neither does the gateway
    try:
        for body, message in cases:
            response = _register(triton_server, "bad", body)
            assert response.status_code == 400, body
            assert message in response.json()["error"], body
    finally:
        link.unlink()
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


def test_an_input_larger_than_a_body_may_be_is_413_before_it_is_read(
    triton_server: ServerProcess,
) -> None:
    """An input is copied out of its region on the event loop, as a body is read: it may
    be no larger than max_request_mb (1 MB here). A 156-byte request read a 512 MB region
    whole, and held every client 1.5 s, before its rows were refused."""
    c = client(triton_server)
    size = 2**20 + BYTES
    key, path = shm_file("big", b"\0" * size)
    try:
        c.register_system_shared_memory("big_input", key, size)
        inputs = [
            httpclient.InferInput(n, [size // BYTES, 16], "INT32") for n in ("INPUT0", "INPUT1")
        ]
        for tensor in inputs:
            tensor.set_shared_memory("big_input", size)
        with pytest.raises(InferenceServerException) as caught:
            c.infer("simple", inputs)
        assert caught.value.status() == "413"
        assert f"names {size} bytes of shared memory region 'big_input'" in caught.value.message()
        assert "max_request_mb" in caught.value.message()
        # The limit is the request's: two inputs of 0.75 MB each, under it alone, are not.
        part = 3 * 2**18
        for tensor in inputs:
            tensor.set_shape([part // BYTES, 16])
            tensor.set_shared_memory("big_input", part)
        with pytest.raises(InferenceServerException) as caught:
            c.infer("simple", inputs)
        assert caught.value.status() == "413"
        assert "input 'INPUT1'" in caught.value.message()
        assert f"bringing the request's to {2 * part}" in caught.value.message()
    finally:
        c.unregister_system_shared_memory("big_input")
        path.unlink()


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


def test_a_region_is_held_open_never_mapped(triton_server: ServerProcess) -> None:
    """The client owns the object and may shrink it: a mapped page past its end is SIGBUS."""
    key = f"/big_{uuid.uuid4().hex[:8]}"
    big = shm.create_shared_memory_region("big", key, 2**20)
    try:
        client(triton_server).register_system_shared_memory("big", key, 100, offset=8)
        assert held(triton_server, key)
        assert not mapped(triton_server, key)
        client(triton_server).unregister_system_shared_memory("big")
        assert not held(triton_server, key)
    finally:
        shm.destroy_shared_memory_region(big)


def _truncate(path: Path) -> None:
    os.truncate(path, 0)


def _replace_shorter(path: Path) -> None:
    path.write_bytes(bytes(BYTES))  # opened with O_TRUNC: a row short of the range


@pytest.mark.parametrize("shrink", [_truncate, _replace_shorter])
def test_an_input_region_whose_object_shrank_is_400(
    triton_server: ServerProcess, shrink: Callable[[Path], None]
) -> None:
    c = client(triton_server)
    key, path = shm_file("shrunk_in", np.ones(32, dtype=np.int32).tobytes())
    try:
        c.register_system_shared_memory("shrunk_in", key, BYTES * 2)
        shrink(path)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("shrunk_in", BYTES)
        inputs[1].set_shared_memory("shrunk_in", BYTES, offset=BYTES)
        with pytest.raises(InferenceServerException) as caught:
            c.infer("simple", inputs)
        assert caught.value.status() == "400"
        assert "region 'shrunk_in'" in caught.value.message()
        assert "register it again" in caught.value.message()
        assert alive(triton_server)
    finally:
        path.unlink()  # first: a server that died before the fix answers no unregister
        c.unregister_system_shared_memory("shrunk_in")


def test_an_output_region_whose_object_shrank_is_400(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    key, path = shm_file("shrunk_out", bytes(BYTES))
    try:
        c.register_system_shared_memory("shrunk_out", key, BYTES)
        os.truncate(path, 0)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("shrunk_out", BYTES)
        with pytest.raises(InferenceServerException) as caught:
            c.infer("simple", inputs, outputs=[output])
        assert caught.value.status() == "400"
        assert "output 'OUTPUT0': shared memory region 'shrunk_out'" in caught.value.message()
        assert "register it again" in caught.value.message()
        assert path.stat().st_size == 0  # not grown back by the write
        assert alive(triton_server)
    finally:
        path.unlink()  # first: a server that died before the fix answers no unregister
        c.unregister_system_shared_memory("shrunk_out")


def _infer_raw(server: ServerProcess, body: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/simple/infer",
        content=body.encode(),
        headers={"content-type": "application/json"},
        timeout=10,
    )


def test_deep_or_huge_shared_memory_parameters_are_400(triton_server: ServerProcess) -> None:
    """Values whose repr passes the recursion limit, or an int-to-str limit, in an error."""
    c = client(triton_server)
    key, path = shm_file("params", bytes(BYTES))
    ones = '{"name": "%s", "datatype": "INT32", "shape": [1, 16], "data": [' + "1," * 15 + "1]}"
    data_inputs = ", ".join(ones % n for n in ("INPUT0", "INPUT1"))
    fields = {
        "shared_memory_region": '"shm_params"',
        "shared_memory_byte_size": str(BYTES),
        "shared_memory_offset": "0",
    }
    try:
        c.register_system_shared_memory("shm_params", key, BYTES)
        for field in fields:
            for value in (DEEP, "18446744073709551615"):
                params = ", ".join(
                    f'"{f}": {value if f == field else v}' for f, v in fields.items()
                )
                as_input = (
                    '{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], '
                    f'"parameters": {{{params}}}}}]}}'
                )
                as_output = (
                    f'{{"inputs": [{data_inputs}], '
                    f'"outputs": [{{"name": "OUTPUT0", "parameters": {{{params}}}}}]}}'
                )
                for body in (as_input, as_output):
                    response = _infer_raw(triton_server, body)
                    assert response.status_code == 400, (field, value[:8], body[:40])
                    assert f"'{field}'" in response.json()["error"], (field, value[:8])
        huge = '{"inputs": [{"name": "INPUT0", "parameters": {"shared_memory_offset": %s}}]}'
        assert _infer_raw(triton_server, huge % ("9" * 5000)).status_code == 400
        assert alive(triton_server)
    finally:
        path.unlink()  # first: a server that died before the fix answers no unregister
        c.unregister_system_shared_memory("shm_params")


def test_deep_or_huge_registration_fields_are_400(triton_server: ServerProcess) -> None:
    key, path = shm_file("reg", bytes(BYTES))
    fields = {"key": f'"{key}"', "offset": "0", "byte_size": str(BYTES)}
    url = f"{triton_server.url}/v2/systemsharedmemory/region/deep/register"
    try:
        for field in fields:
            for value in (DEEP, "18446744073709551615", "9" * 5000):
                body = ", ".join(f'"{f}": {value if f == field else v}' for f, v in fields.items())
                response = httpx.post(url, content=f"{{{body}}}".encode(), timeout=10)
                assert response.status_code == 400, (field, value[:8])
                if len(value) < 5000:  # JSON's reader refuses that one before any field
                    assert f"'{field}'" in response.json()["error"], (field, value[:8])
        assert client(triton_server).get_system_shared_memory_status() == []
        assert alive(triton_server)
    finally:
        path.unlink()


def test_ints_past_the_int_to_str_limit_are_400_naming_the_field(tmp_path: Path) -> None:
    """JSON over HTTP cannot carry them (orjson refuses), but the registry takes any value."""
    (tmp_path / "r").write_bytes(bytes(BYTES))
    regions = SharedMemoryRegions(tmp_path)
    huge = 10**5000
    for offset, byte_size, field in ((huge, 8, "'offset'"), (0, -huge, "'byte_size'")):
        with pytest.raises(BadRequest, match=field):
            regions.register("r", "/r", offset, byte_size)
    regions.register("r", "/r", 0, BYTES)
    try:
        for params, field in (
            ({"shared_memory_region": [huge]}, "'shared_memory_region'"),
            ({"shared_memory_region": "r", "shared_memory_byte_size": huge}, "_byte_size'"),
            (
                {
                    "shared_memory_region": "r",
                    "shared_memory_byte_size": 8,
                    "shared_memory_offset": [[huge]],
                },
                "'shared_memory_offset'",
            ),
        ):
            with pytest.raises(BadRequest, match=field):
                regions.read_input("x", "INT32", (2,), params)
            with pytest.raises(BadRequest, match=field):
                regions.write_output("y", np.ones(2, dtype=np.int32), params)
            with pytest.raises(BadRequest, match=field):  # before the model runs, the same
                regions.check_output("y", params)
        past = {"shared_memory_region": "r", "shared_memory_byte_size": 8}
        past["shared_memory_offset"] = BYTES - 4
        with pytest.raises(BadRequest, match="past the end of shared memory region 'r'"):
            regions.check_output("y", past)
        regions.check_output("y", {**past, "shared_memory_offset": BYTES - 8})  # fits
    finally:
        regions.close_all()


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


def test_the_regions_a_gateway_holds_are_bounded(tmp_path: Path) -> None:
    """Each region holds a descriptor open: past MAX_REGIONS a registration is refused
    (400), until one is unregistered."""
    (tmp_path / "r").write_bytes(bytes(BYTES))
    regions = SharedMemoryRegions(tmp_path)
    try:
        for i in range(MAX_REGIONS):
            regions.register(f"r{i}", "/r", 0, BYTES)
        with pytest.raises(BadRequest, match=f"{MAX_REGIONS} shared memory regions"):
            regions.register("one more", "/r", 0, BYTES)
        regions.unregister("r0")
        regions.register("one more", "/r", 0, BYTES)
    finally:
        regions.close_all()


def test_the_gateways_own_segments_and_long_names_are_not_registered(tmp_path: Path) -> None:
    """The body decoder's segments hold other tenants' request bodies in flight; its
    worker arenas are multiprocessing's. And each region's name is in every status answer:
    128 names of 60 KB made one of 7.5 MB."""
    for key in ("psm_abc", "infergate-decode-42-abcdef"):
        (tmp_path / key).write_bytes(bytes(64))
    (tmp_path / "mine").write_bytes(bytes(64))
    regions = SharedMemoryRegions(tmp_path)
    try:
        for key in ("/psm_abc", "infergate-decode-42-abcdef"):
            with pytest.raises(BadRequest, match="one of the gateway's own segments"):
                regions.register("r", key, 0, 64)
        with pytest.raises(BadRequest, match="at most 256 characters, got 257"):
            regions.register("n" * 257, "/mine", 0, 64)
        regions.register("n" * 256, "/mine", 0, 64)
    finally:
        regions.close_all()
