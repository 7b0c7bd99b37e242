"""Triton's classification extension and compressed responses, through tritonclient."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from infergate.engine.triton.classification import MAX_ENTRIES, MAX_LABELS_BYTES, classify
from infergate.errors import BadRequest
from infergate.server.compression import MIN_BYTES, compress_response
from tests.server import ServerProcess


def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def simple_inputs(input0: np.ndarray, input1: np.ndarray) -> list[httpclient.InferInput]:
    inputs = []
    for name, data in (("INPUT0", input0), ("INPUT1", input1)):
        tensor = httpclient.InferInput(name, list(data.shape), "INT32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


@pytest.mark.parametrize("binary", [True, False])
def test_classification_returns_the_top_k_with_labels(
    triton_server: ServerProcess, binary: bool
) -> None:
    rows = np.stack([np.arange(16, dtype=np.int32), np.arange(16, dtype=np.int32)[::-1]])
    inputs = simple_inputs(rows, np.zeros((2, 16), dtype=np.int32))
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=3),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary),
    ]
    result = client(triton_server).infer("simple", inputs, outputs=outputs)
    top = result.as_numpy("OUTPUT0")
    assert top.shape == (2, 3)  # each row of the batch ranked on its own
    assert [x.decode() if isinstance(x, bytes) else x for x in top[0]] == [
        "15:15:label15",
        "14:14:label14",
        "13:13:label13",
    ]
    assert (top[1][0].decode() if isinstance(top[1][0], bytes) else top[1][0]) == "15:0:label0"
    assert result.as_numpy("OUTPUT1").tolist() == rows.tolist()  # the other is untouched


def test_classification_without_labels_and_bad_counts(triton_server: ServerProcess) -> None:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    output = httpclient.InferRequestedOutput("OUTPUT0", class_count=2)
    c = client(triton_server)
    result = c.infer("simple_fixed", simple_inputs(data, data), outputs=[output])
    assert result.as_numpy("OUTPUT0").tolist() == [b"30:15", b"28:14"]  # no labels.txt

    def executions() -> int:
        stats = httpx.get(f"{triton_server.url}/v2/models/simple/stats", timeout=30).json()
        return int(stats["model_stats"][0]["execution_count"])

    before = executions()
    # Refused before the model runs: found after it, each cost a run, counted a success.
    for parameters, error in [
        ({"classification": "three"}, "classification must be a positive integer"),
        ({"classification": -5}, "classification must be a positive integer"),
        ({"shared_memory_region": "nope", "shared_memory_byte_size": 64}, "not registered"),
    ]:
        response = httpx.post(
            f"{triton_server.url}/v2/models/simple/infer",
            json={
                "inputs": [
                    {"name": n, "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}
                    for n in ("INPUT0", "INPUT1")
                ],
                "outputs": [{"name": "OUTPUT0", "parameters": parameters}],
            },
            timeout=30,
        )
        assert response.status_code == 400
        assert error in response.json()["error"]
    assert executions() == before


def test_classification_is_bounded_by_the_entries_it_makes(tmp_path: Path) -> None:
    """Each entry is a string made on the event loop: k = 2 million over one row of 2
    million values held it 4 s. An answer holds at most MAX_ENTRIES (rows x k); more is a
    400 before any is made, and the bound itself is served."""
    model = tmp_path / "1" / "model.onnx"
    rows = np.zeros((MAX_ENTRIES + 1, 1), dtype=np.float32)
    with pytest.raises(BadRequest, match=f"makes {MAX_ENTRIES + 1} entries; an answer holds"):
        classify("y", rows, 1, True, model)
    with pytest.raises(BadRequest, match="1 row"):
        classify("y", rows.reshape(-1), MAX_ENTRIES + 1, False, model)
    assert classify("y", rows[:MAX_ENTRIES], 5, True, model).shape == (MAX_ENTRIES, 1)


def test_a_labels_file_that_is_no_regular_file_or_too_large_gives_no_labels(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """labels.txt is read on the event loop: a FIFO there held every tenant's requests
    until something wrote to it, and a huge one was read whole. Such a file is said once
    in the log and the answer carries no labels; a regular one still labels."""
    scores = np.array([[0.1, 0.9]], dtype=np.float32)
    fifo_model = tmp_path / "fifo" / "1" / "model.onnx"
    fifo_model.parent.mkdir(parents=True)
    os.mkfifo(fifo_model.parent / "labels.txt")
    big_model = tmp_path / "big" / "1" / "model.onnx"
    big_model.parent.mkdir(parents=True)
    (big_model.parent / "labels.txt").write_bytes(b"x\n" * (MAX_LABELS_BYTES // 2 + 1))
    fine_model = tmp_path / "fine" / "1" / "model.onnx"
    fine_model.parent.mkdir(parents=True)
    (fine_model.parent / "labels.txt").write_text("cat\ndog\n")
    answers: list[object] = []
    reading = threading.Thread(
        target=lambda: answers.append(classify("y", scores, 1, True, fifo_model)), daemon=True
    )
    reading.start()
    reading.join(timeout=30)  # a bound on a call that takes microseconds, not a delay
    assert not reading.is_alive(), "classification blocked on a FIFO labels.txt"
    assert [a.tolist() for a in answers] == [[[b"0.900000:1"]]]  # type: ignore[attr-defined]
    assert classify("y", scores, 1, True, big_model).tolist() == [[b"0.900000:1"]]
    assert classify("y", scores, 1, True, fine_model).tolist() == [[b"0.900000:1:dog"]]
    warned = [r.getMessage() for r in caplog.records if "carry no labels" in r.getMessage()]
    assert len(warned) == 2
    assert "not a regular file" in warned[0]
    assert "larger than 4 MiB" in warned[1]
    classify("y", scores, 1, True, big_model)  # said once, until the file changes
    assert len([r for r in caplog.records if "carry no labels" in r.getMessage()]) == 2


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_responses(triton_server: ServerProcess, algorithm: str) -> None:
    data = np.arange(256, dtype=np.int32).reshape(16, 16)
    result = client(triton_server).infer(
        "simple", simple_inputs(data, data), response_compression_algorithm=algorithm
    )
    assert result.as_numpy("OUTPUT0").tolist() == (data * 2).tolist()
    raw = httpx.post(
        f"{triton_server.url}/v2/models/simple/infer",
        headers={"Accept-Encoding": algorithm},
        json={
            "inputs": [
                {"name": n, "datatype": "INT32", "shape": [16, 16], "data": data.ravel().tolist()}
                for n in ("INPUT0", "INPUT1")
            ]
        },
    )
    assert raw.headers["content-encoding"] == algorithm
    body = raw.read()  # httpx has undone the encoding; check the bytes really were encoded
    assert b'"model_name":"simple"' in body
    assert int(raw.headers["content-length"]) < len(body)  # fewer bytes went over the wire


def test_no_compression_unless_asked(triton_server: ServerProcess) -> None:
    data = np.arange(256, dtype=np.int32).reshape(16, 16)
    raw = httpx.post(
        f"{triton_server.url}/v2/models/simple/infer",
        headers={"Accept-Encoding": "identity"},
        json={
            "inputs": [
                {"name": n, "datatype": "INT32", "shape": [16, 16], "data": data.ravel().tolist()}
                for n in ("INPUT0", "INPUT1")
            ]
        },
    )
    assert "content-encoding" not in raw.headers
    assert int(raw.headers["content-length"]) == len(raw.content)


async def test_aio_client_with_aiohttp_default_accept_encoding(
    triton_server: ServerProcess,
) -> None:
    """aiohttp asks for gzip on every request and tritonclient.http.aio decompresses
    itself: a large answer comes back compressed and right; an error comes back plain."""
    # Imported here, not at the top: aiohttp and its client cost every pytest process that
    # collects this file (five in a parallel run) about 0.1 s of CPU, for this one test.
    import tritonclient.http.aio as aioclient

    data = np.arange(256, dtype=np.int32).reshape(16, 16)
    async with aioclient.InferenceServerClient(triton_server.url.removeprefix("http://")) as c:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = aioclient.InferInput(name, [16, 16], "INT32")
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        result = await c.infer("simple", inputs)
        assert result.as_numpy("OUTPUT1").tolist() == np.zeros((16, 16)).tolist()
        with pytest.raises(InferenceServerException) as caught:
            await c.infer("wrong_model_name", inputs)
        assert caught.value.message().startswith("Request for unknown model")


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        ("gzip", "gzip"),
        ("br, deflate, gzip", "deflate"),
        ("gzip;q=0, deflate;q=0.5", "deflate"),
        ("gzip;q=0", None),
        ("identity", None),
        ("GZIP", "gzip"),
    ],
)
def test_accept_encoding_choice(accept: str, expected: str | None) -> None:
    headers: list[tuple[bytes, bytes]] = []
    body = b"x" * MIN_BYTES
    out = compress_response([(b"accept-encoding", accept.encode())], headers, body, 200)
    assert dict(headers).get(b"content-encoding") == (expected.encode() if expected else None)
    assert (out != body) == (expected is not None)
    small: list[tuple[bytes, bytes]] = []
    assert compress_response([(b"accept-encoding", b"gzip")], small, b"x", 200) == b"x"
    assert compress_response([(b"accept-encoding", b"gzip")], small, body, 503) == body
    assert small == []
