"""BYTES tensors through system shared memory, as Triton's shm string example sends them
(serialized with tritonclient's own helpers)."""

from __future__ import annotations

import uuid

import numpy as np
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient import utils

from tests.server import ServerProcess


def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def string_data() -> tuple[np.ndarray, np.ndarray]:
    numbers = np.arange(16, dtype=np.int32).reshape(1, 16)
    input0 = np.array([str(x).encode() for x in numbers.ravel()], dtype=object).reshape(1, 16)
    input1 = np.array([b"1"] * 16, dtype=object).reshape(1, 16)
    return input0, input1


def test_strings_through_system_shared_memory(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    input0, input1 = string_data()
    wire0 = utils.serialize_byte_tensor(input0)
    wire1 = utils.serialize_byte_tensor(input1)
    size0, size1 = len(wire0.item()), len(wire1.item())  # one bytes object each
    out_size = 1024
    tag = uuid.uuid4().hex[:8]
    inp = shm.create_shared_memory_region("str_in", f"/str_in_{tag}", size0 + size1)
    out = shm.create_shared_memory_region("str_out", f"/str_out_{tag}", out_size * 2)
    try:
        shm.set_shared_memory_region(inp, [wire0])
        shm.set_shared_memory_region(inp, [wire1], offset=size0)
        c.register_system_shared_memory("str_in", f"/str_in_{tag}", size0 + size1)
        c.register_system_shared_memory("str_out", f"/str_out_{tag}", out_size * 2)
        inputs = [httpclient.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("str_in", size0)
        inputs[1].set_shared_memory("str_in", size1, offset=size0)
        outputs = [httpclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
        outputs[0].set_shared_memory("str_out", out_size)
        outputs[1].set_shared_memory("str_out", out_size, offset=out_size)
        result = c.infer("simple_string", inputs, outputs=outputs)
        shape = result.get_output("OUTPUT0")["shape"]
        total = shm.get_contents_as_numpy(out, np.object_, shape)
        difference = shm.get_contents_as_numpy(out, np.object_, shape, offset=out_size)
        assert [int(x) for x in total.ravel()] == [i + 1 for i in range(16)]
        assert [int(x) for x in difference.ravel()] == [i - 1 for i in range(16)]
    finally:
        c.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(inp)
        shm.destroy_shared_memory_region(out)
