"""Plainly bad requests get a 4xx and cost the gateway almost nothing; odd bytes travel
intact (issue 12, the HTTP edge): gzip bombs stop at the limit, refused tenants are
answered before their upload, big bodies decode off the event loop, malformed fields are
400s, and BYTES tensors carry any bytes."""

from __future__ import annotations

import asyncio
import gzip
import mmap
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tomlkit
from onnx import TensorProto, helper
from starlette.types import Message, Receive

from infergate.client import decode_infer_response, encode_infer_request
from infergate.engine.admission.tenants import hash_key
from infergate.errors import BadRequest
from infergate.server.body import read_body
from infergate.server.decoding import KEPT_NOTHING, BodyDecoder, Keeper
from infergate.tensors import Array
from tests.edge_raw import big_json_body, connect, head, read_reply
from tests.health_probe import slow_answers, upload_while_probing
from tests.onnx_models import OPSET, _save, make_mlp
from tests.polling import eventually
from tests.server import ServerProcess

LIMITED_KEY = "ig_limited_tenant_key"
PROFILE = f"""
[server]
max_request_mb = 100

[tenants.default]
class = "burst"

[tenants.limited]
models = ["bytes_echo"]
api_keys = ["{hash_key(LIMITED_KEY)}"]
"""


def _bytes_echo(path: Path) -> None:
    """A scripted model whose BYTES input `x` comes back as `y`, byte for byte."""
    script = {
        "inputs": [{"name": "x", "datatype": "BYTES", "shape": [-1, 3]}],
        "outputs": [{"name": "y", "datatype": "BYTES", "shape": [-1, 3]}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomlkit.dumps(script))


def _onnx_string_echo(path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "strings",
        [helper.make_tensor_value_info("x", TensorProto.STRING, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.STRING, ["n", 3])],
    )
    _save(helper.make_model(graph, opset_imports=OPSET), path)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("edge")
    models = folder / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    _bytes_echo(models / "bytes_echo" / "1" / "model.scripted")
    _onnx_string_echo(models / "onnx_strings" / "1" / "model.onnx")
    profile = folder / "profile.toml"
    profile.write_text(PROFILE)
    proc = ServerProcess(models, profile, folder / "server.log").start()
    yield proc
    proc.stop()


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: peak RSS := current RSS


_BOMB_MB = 512


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """Half a megabyte each, gzip and deflate, that inflates to 512 MB of zeros: one
    deflate stream, wrapped both ways. Each megabyte is compressed alone (a full flush
    after it), so the stream is the first megabyte's piece 512 times and the final block:
    compressing all 512 MB took 3 s of CPU for the same kind of stream."""
    zeros = b"\0" * 2**20
    packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    piece = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    raw = piece * _BOMB_MB + packer.flush()
    crc, adler = 0, 1
    for _ in range(_BOMB_MB):
        crc, adler = zlib.crc32(zeros, crc), zlib.adler32(zeros, adler)
    size = _BOMB_MB * 2**20
    return {
        "gzip": b"\x1f\x8b\x08\0\0\0\0\0\0\xff" + raw + struct.pack("<II", crc, size % 2**32),
        "deflate": b"\x78\x9c" + raw + struct.pack(">I", adler),
    }


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compression_bomb_stops_at_the_limit_without_inflating(
    edge: ServerProcess, bombs: dict[str, bytes], encoding: str
) -> None:
    assert edge.process is not None
    assert zlib.decompressobj(47).decompress(bombs[encoding], 1000) == b"\0" * 1000
    _reset_peak_rss(edge.process.pid)
    before = _peak_rss_kb(edge.process.pid)
    r = httpx.post(
        f"{edge.url}/v2/models/mlp/infer",
        content=bombs[encoding],
        headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
        timeout=60,
    )
    grew_mb = (_peak_rss_kb(edge.process.pid) - before) / 1024
    assert r.status_code == 413, r.text
    assert "100 MB limit" in r.json()["error"]
    # Refused at 100 MB inflated: the peak may hold about that much, never the 512 MB.
    assert grew_mb < 250, f"the gateway's peak RSS grew {grew_mb:.0f} MB"


def test_compressed_bodies_still_work_and_a_truncated_one_is_a_400(edge: ServerProcess) -> None:
    body = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    )
    url = f"{edge.url}/v2/models/mlp/infer"
    for encoding, packed in (("gzip", gzip.compress(body) * 1), ("deflate", zlib.compress(body))):
        assert httpx.post(url, content=packed, headers={"Content-Encoding": encoding}).is_success
    two_members = gzip.compress(body[:10]) + gzip.compress(body[10:])
    assert httpx.post(url, content=two_members, headers={"Content-Encoding": "gzip"}).is_success
    cut = httpx.post(url, content=gzip.compress(body)[:-12], headers={"Content-Encoding": "gzip"})
    assert cut.status_code == 400
    assert "does not decompress" in cut.json()["error"]


def test_a_forbidden_tenant_is_refused_before_its_body_is_sent(edge: ServerProcess) -> None:
    """A 60 MB upload announced but never sent: the 403 comes without waiting for it."""
    with connect(edge.port) as sock:
        started = time.monotonic()
        sock.sendall(
            head(
                "POST",
                "/v2/models/mlp/infer",
                edge.port,
                {"Content-Length": str(60 * 2**20), "X-API-Key": LIMITED_KEY},
            )
        )
        reply = read_reply(sock, timeout_s=20)
        waited = time.monotonic() - started
    assert reply is not None
    assert reply.status == 403
    assert "may not use model 'mlp'" in str(reply.json()["error"])
    assert waited < 10  # today it waits for a body that never comes


def _big_bytes_body() -> tuple[bytes, dict[str, str]]:
    """60 MB of binary BYTES data: a million 60-byte elements."""
    strings = np.full(2**20, b"0" * 60, dtype=object)  # the decode's work is the same
    body, headers = encode_infer_request({"x": strings}, binary=True)
    return body, headers


@pytest.mark.serial  # health latency against a wall clock: run alone
@pytest.mark.parametrize("make_body", [big_json_body, _big_bytes_body], ids=["json", "bytes"])
def test_health_answers_quickly_while_a_60_mb_body_decodes(
    edge: ServerProcess, make_body: object, tmp_path: Path
) -> None:
    assert callable(make_body)
    body, body_headers = make_body()
    # Health is asked from a process of its own (tests/health_probe.py): this one's
    # garbage collector, not the gateway, made the slow answers once.
    reply, during = upload_while_probing(
        edge.url, edge.port, "/v2/models/mlp/infer", body, body_headers, tmp_path
    )
    # The body was decoded in full (its tensor is named and described in the answer),
    # then refused by the model's input check: the time until the answer was the decode.
    assert reply is not None
    assert f"{reply.status} {reply.json()['error']}".startswith("400 input 'x'"), reply
    # Health was answered again and again while the body decoded (a decode on the event
    # loop lets through one check at most, the one it held up) and never slowly.
    assert len(during) >= 20, len(during)
    slow = slow_answers(during)
    assert not slow, f"health answers of 100 ms or more (s after the upload, took s): {slow}"


def _receive_of(body: bytes, piece: int = 65536) -> Receive:
    """An ASGI receive handing over `body` in pieces, as a server does."""
    pieces = [body[i : i + piece] for i in range(0, len(body), piece)]

    async def receive() -> Message:
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    return receive


def _mapping_of(array: Array) -> mmap.mmap:
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview), f"{type(base)}: not a view of a mapping"
    assert isinstance(base.obj, mmap.mmap)
    return base.obj


@pytest.mark.parametrize("sent_as", ["with its length", "chunked", "gzip"])
async def test_a_large_body_and_its_tensors_are_let_go_of_off_the_event_loop(
    sent_as: str,
) -> None:
    """Zero-filling or freeing tens of megabytes takes a thread 10 to 30 ms: never the
    event loop's. A large body arrives in a mapping whose pages its own pieces touch
    first, and it and the tensors decoded from it are freed by the freeing thread once
    the answer is sent (Keeper.release), not by the loop that drops the request."""
    count = 2**19  # 2 MB as JSON: past the inline limit, decoded by the helper
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [count], "data": [0.5] * count}]}
    raw = orjson.dumps(doc)
    sent, headers = raw, {b"content-length": b"%d" % len(raw)}
    if sent_as == "chunked":
        headers = {}
    elif sent_as == "gzip":
        sent = gzip.compress(raw, 1)
        headers = {b"content-length": b"%d" % len(sent), b"content-encoding": b"gzip"}
    body = await read_body(headers, _receive_of(sent), 100 * 2**20)
    assert isinstance(body, memoryview)
    assert isinstance(body.obj, mmap.mmap)
    assert body == raw
    freed_on: list[str] = []

    def freed() -> None:
        freed_on.append(threading.current_thread().name)

    weakref.finalize(body.obj, freed)
    decoder, keeper = BodyDecoder(), Keeper()
    try:
        decoded = await decoder.decode(body, None, keeper)
    finally:
        decoder.close()
    assert decoded.inputs["x"].shape == (count,)
    assert float(decoded.inputs["x"][-1]) == 0.5
    weakref.finalize(_mapping_of(decoded.inputs["x"]), freed)
    del body, decoded  # the request lets go of them: the keeper still holds them
    assert freed_on == []
    assert keeper.holding
    await keeper.release()
    await eventually(lambda: len(freed_on) == 2, what="the body and its tensor freed")
    assert [name.split("_")[0] for name in freed_on] == ["ig-free", "ig-free"], freed_on


MALFORMED = [
    (
        "shape overflows",
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2**63, 64], "data": [1]}]},
        {},
        "more elements than any tensor",
    ),
    (
        "datatype not a string",
        {"inputs": [{"name": "x", "datatype": ["FP32"], "shape": [1, 4], "data": [1, 2, 3, 4]}]},
        {},
        "datatype",
    ),
    (
        "output parameters not an object",
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
            "outputs": [{"name": "y", "parameters": [1]}],
        },
        {},
        "outputs[0].parameters must be an object",
    ),
    (
        "binary_data not a boolean",
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
            "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}],
        },
        {},
        "binary_data must be true or false",
    ),
    (
        "binary_data_output not a boolean",
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
            "parameters": {"binary_data_output": 1},
        },
        {},
        "binary_data_output must be true or false",
    ),
    (
        "header length not ASCII",
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
        {"Inference-Header-Content-Length": "\u00bd"},
        "not ASCII",
    ),
    (
        "content encoding not ASCII",
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
        {"Content-Encoding": "gz\u00efp"},
        "not supported",
    ),
]


@pytest.mark.parametrize(
    ("doc", "headers", "message"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_every_malformed_field_is_a_400(
    edge: ServerProcess, doc: dict[str, object], headers: dict[str, str], message: str
) -> None:
    r = httpx.post(
        f"{edge.url}/v2/models/mlp/infer",
        content=orjson.dumps(doc),
        headers={k.encode(): v.encode("latin-1") for k, v in headers.items()},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


EVERY_BYTE = bytes(range(256))
ODD_BYTES = np.array(
    [[EVERY_BYTE, b"", b"\x00"], [b"a\x00", b"\xff\xfe\xc3(", "caf\u00e9".encode()]], dtype=object
)


def test_bytes_tensors_round_trip_exactly_as_binary_data(edge: ServerProcess) -> None:
    body, headers = encode_infer_request({"x": ODD_BYTES}, outputs=["y"], binary=True)
    r = httpx.post(f"{edge.url}/v2/models/bytes_echo/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    out = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))
    assert out.outputs["y"].tolist() == ODD_BYTES.tolist()


def test_a_large_body_s_shape_or_header_length_is_refused_before_any_work(
    edge: ServerProcess,
) -> None:
    """Over 1 MB a body is decoded off the loop, in slices; a shape claiming more BYTES
    elements than a request may hold (a 413), or more than its bytes can hold, or a header
    length of thousands of digits (400s) is refused before anything is built for it (a 1 GB
    array of 134 million elements before)."""
    data = b"\0" * 1_200_000  # 300,000 empty elements at most

    def claiming(elements: int, length: str | None = None) -> httpx.Response:
        tensor = {"name": "x", "datatype": "BYTES", "shape": [1, elements]}
        header = orjson.dumps(
            {"inputs": [{**tensor, "parameters": {"binary_data_size": len(data)}}]}
        )
        return httpx.post(
            f"{edge.url}/v2/models/bytes_echo/infer",
            content=header + data,
            headers={"Inference-Header-Content-Length": length or str(len(header))},
            timeout=30,
        )

    r = claiming(134_217_728)
    assert r.status_code == 413, r.text
    assert "brings the request to 134217728 BYTES elements" in r.json()["error"]
    r = claiming(400_000)
    assert r.status_code == 400, r.text
    assert "too few for the 400000 BYTES elements" in r.json()["error"]
    r = claiming(400_000, "0" * 5000 + "100")
    assert r.status_code == 400, r.text
    assert "Inference-Header-Content-Length has 5003 digits" in r.json()["error"]


def test_bytes_that_json_cannot_carry_are_refused_not_replaced(edge: ServerProcess) -> None:
    body, headers = encode_infer_request({"x": ODD_BYTES}, binary=True)
    doc_end = int(headers["Inference-Header-Content-Length"])
    doc = orjson.loads(body[:doc_end])
    doc["parameters"]["binary_data_output"] = False  # ask for JSON outputs
    header = orjson.dumps(doc)
    r = httpx.post(
        f"{edge.url}/v2/models/bytes_echo/infer",
        content=header + body[doc_end:],
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 400, r.text
    assert "not UTF-8" in r.json()["error"]
    assert "binary_data" in r.json()["error"]


def test_an_onnx_string_model_gets_the_bytes_sent_or_says_why_not(edge: ServerProcess) -> None:
    text = np.array([["caf\u00e9".encode(), b"a\x00b", b""]], dtype=object)
    body, headers = encode_infer_request({"x": text}, outputs=["y"], binary=True)
    r = httpx.post(f"{edge.url}/v2/models/onnx_strings/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    out = decode_infer_response(r.content, r.headers.get("inference-header-content-length"))
    assert out.outputs["y"].tolist() == text.tolist()

    # Not UTF-8: the model gets the bytes, and onnxruntime cannot hand them back as bytes,
    # so the answer is an error that says so, never U+FFFD in their place: the request's
    # fault (400), which the model's breaker does not count against it.
    def failures() -> int:
        (view,) = [
            b
            for b in httpx.get(f"{edge.url}/admin/breakers").json()
            if b["model"] == "onnx_strings"
        ]
        return int(view["window_failures"])

    before = failures()
    odd = np.array([[b"\xff\xfe", b"ok", b"\xc3("]], dtype=object)
    body, headers = encode_infer_request({"x": odd}, outputs=["y"], binary=True)
    for _ in range(3):
        r = httpx.post(f"{edge.url}/v2/models/onnx_strings/infer", content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert "not UTF-8" in r.json()["error"]
        assert "Hint: send text" in r.json()["error"]
    assert failures() == before


@pytest.mark.parametrize(
    ("declared", "sent", "piece", "error"),
    [
        (1000, 1000, 1000, None),  # whole in one message: taken as it is
        (100_000, 100_000, 30_000, None),  # in four pieces
        (1000, 999, 1000, "the body has 999 bytes but Content-Length says 1000"),
        (1000, 999, 500, "the body has 999 bytes but Content-Length says 1000"),
    ],
)
def test_a_body_is_read_whole_whether_it_comes_in_one_piece_or_several(
    declared: int, sent: int, piece: int, error: str | None
) -> None:
    body = bytes(range(256)) * (sent // 256) + b"x" * (sent % 256)
    headers = {b"content-length": str(declared).encode()}
    if error is None:
        assert bytes(asyncio.run(read_body(headers, _receive_of(body, piece), 2**20))) == body
    else:
        with pytest.raises(BadRequest, match=error):
            asyncio.run(read_body(headers, _receive_of(body, piece), 2**20))


def test_the_shared_keeper_of_answers_that_hold_nothing_refuses_to_keep_anything() -> None:
    """KEPT_NOTHING is every such answer's: a buffer kept into it would be every other
    request's to hold, and never let go of."""
    for keep in (KEPT_NOTHING.keep, KEPT_NOTHING.keep_elements, KEPT_NOTHING.keep_buffer):
        with pytest.raises(TypeError, match="keeps nothing"):
            keep([b"x"])  # type: ignore[arg-type]
    assert not KEPT_NOTHING.holding
