"""`[server] fronts`: a client cannot tell a gateway behind a front process from one
process. A broad corpus of requests (valid and invalid V2 JSON of every datatype, binary
tensors, BYTES, classification, compression both ways, keys, versions, odd HTTP) goes to
one process and to a gateway with a front on the same models, and every answer must be
byte for byte the same (status line, headers in order, body; the Date aside). Keys,
limits and revocations are compared as they change. And what a front decodes for the
engine (server/predecode.py) is only what the engine would decode: a request it refuses
first (an unknown model, a tenant over its rate) costs the front no decoding, as it costs
one process none."""

from __future__ import annotations

import asyncio
import gzip
import re
import socket
import struct
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
import orjson
import pytest
from onnx import helper

from infergate.engine.admission.tenants import hash_key
from infergate.server.front import EngineLink, ForwardRoute
from infergate.server.infer_route import Reply
from infergate.server.link import LinkProtocol, Message
from infergate.server.predecode import pack
from infergate.tensors import V2_TO_NUMPY
from tests.onnx_models import ECHO_TYPES, OPSET, _save, make_mlp
from tests.polling import wait_until
from tests.scripted_runtime import holding, make_scripted
from tests.server import ServerProcess
from tests.triton_models import make_simple, make_simple_string

KEY, SLOW, SINGLE, REVOKED = "parity-key", "slow-key", "single-key", "revoked-key"
NUMBERS = [t for t in ECHO_TYPES if t != "BYTES"]
ID = "parity-1"  # every request's X-Request-ID, so that answers can be the same


def _profile(fronts: int, revoked: bool = False) -> str:
    keys = "[]" if revoked else f'["{hash_key(REVOKED)}"]'
    return (
        f"[server]\nfronts = {fronts}\nmax_request_mb = 0.5\nallow_anonymous = true\n\n"
        # The batch class (a 30 s queue deadline): on a busy machine the burst class's 200 ms
        # expired a request of the many-clients test in one server and not the other.
        '[tenants.default]\nclass = "batch"\n\n'
        f'[tenants.parity]\nclass = "batch"\napi_keys = ["{hash_key(KEY)}"]\n\n'
        # A bucket that refills in hours: its third request and on are 429s, all alike.
        f'[tenants.slow]\nrps = 0.0001\nburst = 2\napi_keys = ["{hash_key(SLOW)}"]\n\n'
        f'[tenants.single]\nmax_concurrency = 1\napi_keys = ["{hash_key(SINGLE)}"]\n\n'
        f"[tenants.revocable]\napi_keys = {keys}\n"
    )


def _make_numbers_echo(path: Path) -> Path:
    """in_<TYPE> -> out_<TYPE> for every numeric datatype, any shape of rank 2 (tests'
    echo model also takes BYTES, which a front never decodes)."""
    inputs, outputs, nodes = [], [], []
    for name in NUMBERS:
        inputs.append(helper.make_tensor_value_info(f"in_{name}", ECHO_TYPES[name], ["a", "b"]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", ECHO_TYPES[name], ["a", "b"]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    graph = helper.make_graph(nodes, "numbers", inputs, outputs)
    return _save(helper.make_model(graph, opset_imports=OPSET), path)


class Pair(NamedTuple):
    one: ServerProcess  # one process
    split: ServerProcess  # the engine behind a front
    folder: Path
    gates: Path


def _start(server: ServerProcess, fronts: int) -> ServerProcess:
    logged = server.log.stat().st_size if server.log.exists() else 0
    server.start()
    if fronts:  # ready comes from the front; the engine says when every front listens
        wait_until(lambda: b"front processes)" in server.log.read_bytes()[logged:], 60, "fronts")
    return server


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """The same models in one process and behind one front (one, so that the requests of
    one connection and the next all meet the same front's memory of keys: what it decodes
    is then known; two fronts answer alike, test_fronts.py)."""
    folder = tmp_path_factory.mktemp("parity")
    models, gates = folder / "models", folder / "gates"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    make_mlp(models / "mlp" / "2" / "model.onnx", offset=1.0)
    _make_numbers_echo(models / "numbers" / "1" / "model.onnx")
    make_simple(models / "simple" / "1" / "model.onnx")
    (models / "simple" / "labels.txt").write_text("\n".join(f"label{i}" for i in range(16)))
    make_simple_string(models / "simple_string" / "1" / "model.onnx")
    make_scripted(models / "held" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    servers = []
    for fronts in (0, 1):
        profile = folder / f"profile-{fronts}.toml"
        profile.write_text(_profile(fronts))
        servers.append(ServerProcess(models, profile, folder / f"server-{fronts}.log"))
    try:
        with ThreadPoolExecutor(2) as starting:  # both at once: each takes seconds of waiting
            one, split = starting.map(_start, servers, (0, 1))
        yield Pair(one, split, folder, gates)
    finally:
        for server in servers:
            server.stop()


# -- raw HTTP: the bytes as sent and as answered ------------------------------------------


def _request(
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    http: str = "1.1",
) -> bytes:
    lines = [f"{method} {path} HTTP/{http}", "Host: gateway", f"X-Request-ID: {ID}"]
    given = dict(headers or {})
    named = {k.lower() for k in given}
    if body is not None and not {"content-length", "transfer-encoding"} & named:
        given["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in given.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def _infer(
    body: bytes,
    model: str = "mlp",
    key: str | None = KEY,
    version: str | None = None,
    **headers: str,
) -> bytes:
    path = f"/v2/models/{model}" + ("" if version is None else f"/versions/{version}") + "/infer"
    given = {k.replace("_", "-"): v for k, v in headers.items()}
    if key is not None:
        given["X-API-Key"] = key
    return _request("POST", path, body, given)


def _chunked(request: bytes) -> bytes:
    """`request` with its body sent chunked (the ASGI route's, in a front passed on)."""
    head, _, body = request.partition(b"\r\n\r\n")
    head = re.sub(rb"\r\nContent-Length: \d+", b"", head) + b"\r\nTransfer-Encoding: chunked"
    framed = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    return head + b"\r\n\r\n" + framed


def _one_answer(data: bytes) -> tuple[bytes, bytes] | None:
    """The first whole answer in `data` (its raw bytes) and what follows, or None."""
    head, found, rest = data.partition(b"\r\n\r\n")
    if not found:
        return None
    fields = head.lower().split(b"\r\n")
    if fields[0].split()[1].startswith(b"1"):  # 100 Continue: a head alone
        return head + found, rest
    length = next((int(f.split(b":")[1]) for f in fields if f.startswith(b"content-length:")), 0)
    if len(rest) < length:
        return None
    return head + found + rest[:length], rest[length:]


def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` answers as the server wrote them (the Date's value blanked), fewer if it
    closes the connection first."""
    sock.settimeout(30)
    got: list[bytes] = []
    data = b""
    while len(got) < count:
        cut = _one_answer(data)
        if cut is not None:
            got.append(re.sub(rb"\r\ndate: [^\r]*", b"\r\ndate: -", cut[0]))
            data = cut[1]
            continue
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return got


def _exchange(port: int, data: bytes, count: int = 1) -> list[bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return _answers(sock, count)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _tenant(server: ServerProcess, name: str) -> dict[str, Any]:
    doc = httpx.get(f"{server.url}/admin/tenants", timeout=10).json()
    found: dict[str, Any] = next(t for t in doc["tenants"] if t["name"] == name)
    return found


# -- the corpus ---------------------------------------------------------------------------


def _json(doc: Any) -> bytes:
    return orjson.dumps(doc)


X = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
GOOD = _json({"inputs": [X]})


def _numbers(rows: int = 1, **change: Any) -> list[dict[str, Any]]:
    """One input of each numeric datatype for the numbers model, `change[TYPE]` replacing
    fields of that one."""
    inputs = []
    for t in NUMBERS:
        data: list[Any] = [True, False] * rows if t == "BOOL" else [1, 0] * rows
        if t.startswith("FP"):
            data = [0.1, -2.5] * rows
        tensor = {"name": f"in_{t}", "datatype": t, "shape": [rows, 2], "data": data}
        tensor.update(change.get(t, {}))
        inputs.append(tensor)
    return inputs


def _binary(arrays: dict[str, np.ndarray[Any, Any]], **doc: Any) -> tuple[bytes, str]:
    """A binary-extension body: its JSON header (with `doc`), then the tensors' bytes."""
    header: dict[str, Any] = {"inputs": [], **doc}
    blobs = []
    for name, array in arrays.items():
        datatype = name.removeprefix("in_")
        blob = array.tobytes()
        header["inputs"].append(
            {
                "name": name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(blob)},
            }
        )
        blobs.append(blob)
    json_part = _json(header)
    return json_part + b"".join(blobs), str(len(json_part))


def _bytes_wire(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def _corpus() -> dict[str, tuple[bytes, int]]:
    """Requests by name: the raw request (or several, pipelined), and how many answers."""
    arrays: dict[str, np.ndarray[Any, Any]] = {
        f"in_{t}": np.array([[1, 0], [0, 1]], dtype=V2_TO_NUMPY[t]) for t in NUMBERS
    }
    arrays["in_BOOL"] = np.frombuffer(bytes([2, 0, 1, 255]), np.bool_).reshape(2, 2)
    arrays["in_FP16"] = np.array([[np.nan, np.inf], [-0.0, 65504]], np.float16)
    binary, length = _binary(arrays)
    binary_out, length_out = _binary(arrays, parameters={"binary_data_output": True})
    big = _json({"inputs": [{**X, "shape": [300, 4], "data": [0.25] * 1200}]})
    strings = {"datatype": "BYTES", "shape": [1, 16]}
    string_doc = {
        "inputs": [
            {"name": "INPUT0", **strings, "data": ["3"] * 16},
            {"name": "INPUT1", **strings, "data": ["1"] * 16},
        ]
    }
    wire0, wire1 = _bytes_wire([b"7"] * 16), _bytes_wire([b"2"] * 16)
    string_header = _json(
        {
            "inputs": [
                {"name": "INPUT0", **strings, "parameters": {"binary_data_size": len(wire0)}},
                {"name": "INPUT1", **strings, "parameters": {"binary_data_size": len(wire1)}},
            ]
        }
    )
    ints = {"datatype": "INT32", "shape": [1, 16]}
    simple = {
        "inputs": [
            {"name": "INPUT0", **ints, "data": list(range(16))},
            {"name": "INPUT1", **ints, "data": [1] * 16},
        ]
    }
    deep = b"[" * 1000 + b"1" + b"]" * 1000
    no_data = {"name": "x", "datatype": "FP32", "shape": [1, 4]}
    escaped_shm = _json(
        {"inputs": [X], "outputs": [{"name": "y", "parameters": {"SHM": "nowhere"}}]}
    ).replace(b'"SHM"', b'"shared\\u005fmemory_region"')
    c: dict[str, tuple[bytes, int]] = {
        "plain": (_infer(GOOD), 1),
        "no key": (_infer(GOOD, key=None), 1),
        "bearer key": (
            _request("POST", "/v2/models/mlp/infer", GOOD, {"Authorization": f"bearer  {KEY} "}),
            1,
        ),
        "key and bearer": (_infer(GOOD, authorization=f"Bearer {KEY}x"), 1),
        "wrong key": (_infer(GOOD, key="wrong"), 1),
        "wrong key, bad body": (_infer(b"{", key="wrong"), 1),
        "blank key": (_infer(GOOD, key="   "), 1),
        "id": (_infer(_json({"id": "abc", "inputs": [X]})), 1),
        "numeric id": (_infer(_json({"id": 7, "inputs": [X]})), 1),
        "float id": (_infer(_json({"id": 1.5e300, "inputs": [X]})), 1),
        "unicode id": (_infer(_json({"id": "é\u2028\x00", "inputs": [X]})), 1),
        "list id": (_infer(_json({"id": [1], "inputs": [X]})), 1),
        "binary output": (
            _infer(_json({"inputs": [X], "parameters": {"binary_data_output": True}})),
            1,
        ),
        "binary output not bool": (
            _infer(_json({"inputs": [X], "parameters": {"binary_data_output": 1}})),
            1,
        ),
        "outputs": (_infer(_json({"inputs": [X], "outputs": [{"name": "y"}]})), 1),
        "outputs empty": (_infer(_json({"inputs": [X], "outputs": []})), 1),
        "outputs twice": (
            _infer(_json({"inputs": [X], "outputs": [{"name": "y"}, {"name": "y"}]})),
            1,
        ),
        "outputs unknown": (_infer(_json({"inputs": [X], "outputs": [{"name": "z"}]})), 1),
        "output binary": (
            _infer(
                _json(
                    {"inputs": [X], "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
                )
            ),
            1,
        ),
        "classification": (
            _infer(
                _json(
                    {"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": 2}}]}
                )
            ),
            1,
        ),
        "other output parameter": (
            _infer(_json({"inputs": [X], "outputs": [{"name": "y", "parameters": {"p": [1]}}]})),
            1,
        ),
        "escaped shared memory output": (_infer(escaped_shm), 1),
        "shared memory input": (
            _infer(
                _json(
                    {
                        "inputs": [
                            {
                                **no_data,
                                "parameters": {
                                    "shared_memory_region": "r",
                                    "shared_memory_byte_size": 16,
                                },
                            }
                        ]
                    }
                )
            ),
            1,
        ),
        "nested data": (_infer(_json({"inputs": [{**X, "data": [[1, 2, 3, 4]]}]})), 1),
        "ragged data": (_infer(_json({"inputs": [{**X, "data": [[1, 2], [3]]}]})), 1),
        "deep data": (
            _infer(_json({"inputs": [{**X, "data": "DEEP"}]}).replace(b'"DEEP"', deep)),
            1,
        ),
        "deep parameters": (
            _infer(_json({"inputs": [X], "parameters": {"deep": "DEEP"}}).replace(b'"DEEP"', deep)),
            1,
        ),
        "deep output parameters": (
            _infer(
                _json(
                    {"inputs": [X], "outputs": [{"name": "y", "parameters": {"deep": "DEEP"}}]}
                ).replace(b'"DEEP"', deep)
            ),
            1,
        ),
        "zero rows": (_infer(_json({"inputs": [{**X, "shape": [0, 4], "data": []}]})), 1),
        "zero rows, huge width": (
            _infer(_json({"inputs": [{**X, "shape": [0, 2**40], "data": []}]})),
            1,
        ),
        "scalar": (_infer(_json({"inputs": [{**X, "shape": [], "data": [1]}]})), 1),
        "scalar data": (_infer(_json({"inputs": [{**X, "shape": [], "data": 1}]})), 1),
        "wrong shape": (_infer(_json({"inputs": [{**X, "shape": [2, 2]}]})), 1),
        "wrong datatype": (_infer(_json({"inputs": [{**X, "datatype": "FP64"}]})), 1),
        "unknown datatype": (_infer(_json({"inputs": [{**X, "datatype": "FLOAT"}]})), 1),
        "two inputs of a name": (_infer(_json({"inputs": [X, X]})), 1),
        "unexpected input": (_infer(_json({"inputs": [X, {**X, "name": "z"}]})), 1),
        "duplicate keys": (
            _infer(GOOD[:-1] + b',"inputs":[' + _json({**X, "data": [5, 6, 7, 8]}) + b"]}"),
            1,
        ),
        "NaN": (_infer(GOOD.replace(b"[1,2,3,4]", b"[NaN,2,3,4]")), 1),
        "Infinity": (_infer(GOOD.replace(b"[1,2,3,4]", b"[Infinity,2,3,4]")), 1),
        "past FP32": (_infer(GOOD.replace(b"[1,2,3,4]", b"[1e39,2,3,4]")), 1),
        "past double": (_infer(GOOD.replace(b"[1,2,3,4]", b"[1e400,2,3,4]")), 1),
        "huge integer": (
            _infer(GOOD.replace(b"[1,2,3,4]", b"[100000000000000000000000,2,3,4]")),
            1,
        ),
        "true in FP32": (_infer(GOOD.replace(b"[1,2,3,4]", b"[true,2.5,3,4]")), 1),
        "string in FP32": (_infer(GOOD.replace(b"[1,2,3,4]", b'["1",2,3,4]')), 1),
        "null in FP32": (_infer(GOOD.replace(b"[1,2,3,4]", b"[null,2,3,4]")), 1),
        "not UTF-8": (_infer(b'{"id":"\xff","inputs":[' + _json(X) + b"]}"), 1),
        "lone surrogate": (_infer(b'{"id":"\\ud800","inputs":[' + _json(X) + b"]}"), 1),
        "BOM": (_infer(b"\xef\xbb\xbf" + GOOD), 1),
        "empty body": (_infer(b""), 1),
        "not an object": (_infer(b"[1]"), 1),
        "no inputs": (_infer(b'{"inputs":[]}'), 1),
        "timeout": (_infer(_json({"inputs": [X], "parameters": {"timeout": 60_000_000}})), 1),
        "bad timeout": (_infer(_json({"inputs": [X], "parameters": {"timeout": -1}})), 1),
        "bad priority": (_infer(_json({"inputs": [X], "parameters": {"priority": "high"}})), 1),
        "bad sequence": (_infer(_json({"inputs": [X], "parameters": {"sequence_id": [1]}})), 1),
        "header length": (_infer(GOOD, inference_header_content_length=str(len(GOOD))), 1),
        "header length spaced": (_infer(GOOD, inference_header_content_length=f" {len(GOOD)} "), 1),
        "header length short": (
            _infer(GOOD, inference_header_content_length=str(len(GOOD) - 1)),
            1,
        ),
        "header length long": (_infer(GOOD, inference_header_content_length=str(len(GOOD) + 1)), 1),
        "header length negative": (_infer(GOOD, inference_header_content_length="-1"), 1),
        "header length huge": (_infer(GOOD, inference_header_content_length="9" * 30), 1),
        "header length not ASCII": (_infer(GOOD, inference_header_content_length="\xb9"), 1),
        "header length 0": (_infer(GOOD, inference_header_content_length="0"), 1),
        "binary every number": (
            _infer(binary, "numbers", inference_header_content_length=length),
            1,
        ),
        "binary every number, binary out": (
            _infer(binary_out, "numbers", inference_header_content_length=length_out),
            1,
        ),
        "binary unclaimed bytes": (
            _infer(binary + b"x", "numbers", inference_header_content_length=length),
            1,
        ),
        "binary too few bytes": (
            _infer(binary[:-1], "numbers", inference_header_content_length=length),
            1,
        ),
        "JSON every number": (_infer(_json({"inputs": _numbers(2)}), "numbers"), 1),
        "JSON every number, zero rows": (_infer(_json({"inputs": _numbers(0)}), "numbers"), 1),
        "JSON every number, binary out": (
            _infer(
                _json({"inputs": _numbers(3), "parameters": {"binary_data_output": True}}),
                "numbers",
            ),
            1,
        ),
        "JSON some outputs": (
            _infer(
                _json(
                    {
                        "inputs": _numbers(),
                        "outputs": [
                            {"name": "out_FP16"},
                            {"name": "out_BOOL", "parameters": {"binary_data": True}},
                            {"name": "out_UINT64"},
                        ],
                    }
                ),
                "numbers",
            ),
            1,
        ),
        "extremes": (
            _infer(
                _json(
                    {
                        "inputs": _numbers(
                            INT64={"data": [-(2**63), 2**63 - 1]},
                            UINT32={"data": [0, 2**32 - 1]},
                            FP16={"data": [65519, -65504]},
                            FP32={"data": [1e-45, 3.4028235e38]},
                            FP64={"data": [5e-324, 1.7976931348623157e308]},
                        )
                    }
                ),
                "numbers",
            ),
            1,
        ),
        "past INT8": (_infer(_json({"inputs": _numbers(INT8={"data": [128, 0]})}), "numbers"), 1),
        "past UINT64": (
            _infer(_json({"inputs": _numbers(UINT64={"data": [2**64 - 1, 0]})}), "numbers"),
            1,
        ),
        "past FP16": (_infer(_json({"inputs": _numbers(FP16={"data": [65520, 0]})}), "numbers"), 1),
        "fraction in INT32": (
            _infer(_json({"inputs": _numbers(INT32={"data": [1.5, 0]})}), "numbers"),
            1,
        ),
        "integers in BOOL": (
            _infer(_json({"inputs": _numbers(BOOL={"data": [1, 0]})}), "numbers"),
            1,
        ),
        "BOOL in INT16": (
            _infer(_json({"inputs": _numbers(INT16={"data": [True, False]})}), "numbers"),
            1,
        ),
        "BYTES": (_infer(_json(string_doc), "simple_string"), 1),
        "BYTES binary": (
            _infer(
                string_header + wire0 + wire1,
                "simple_string",
                inference_header_content_length=str(len(string_header)),
            ),
            1,
        ),
        "BYTES binary out": (
            _infer(
                _json({**string_doc, "parameters": {"binary_data_output": True}}), "simple_string"
            ),
            1,
        ),
        "BYTES as numbers": (
            _infer(_json({"inputs": simple["inputs"]}), "simple_string"),
            1,
        ),
        "numbers as BYTES": (
            _infer(_json({"inputs": string_doc["inputs"]}), "simple"),
            1,
        ),
        "INT32 classification": (
            _infer(
                _json(
                    {
                        **simple,
                        "outputs": [
                            {"name": "OUTPUT0", "parameters": {"classification": 3}},
                            {"name": "OUTPUT1", "parameters": {"binary_data": True}},
                        ],
                    }
                ),
                "simple",
            ),
            1,
        ),
        "bad classification": (
            _infer(
                _json(
                    {
                        **simple,
                        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": -1}}],
                    }
                ),
                "simple",
            ),
            1,
        ),
        "gzip answer": (_infer(big, accept_encoding="gzip"), 1),
        "deflate answer": (_infer(big, accept_encoding="deflate"), 1),
        "gzip refused": (_infer(big, accept_encoding="gzip;q=0, br"), 1),
        "gzip asked, upper case": (_infer(big, accept_encoding="GZIP;q=0.5"), 1),
        "gzip asked, bad q": (_infer(big, accept_encoding="gzip;q=x, deflate"), 1),
        "gzip binary answer": (
            _infer(
                big.replace(b'{"inputs"', b'{"parameters":{"binary_data_output":true},"inputs"'),
                accept_encoding="gzip",
            ),
            1,
        ),
        "gzip small answer": (_infer(GOOD, accept_encoding="gzip"), 1),
        "gzip error": (_infer(b"{", accept_encoding="gzip"), 1),
        "gzip body": (_infer(gzip.compress(GOOD), content_encoding="gzip"), 1),
        "deflate body": (_infer(zlib.compress(GOOD), content_encoding="deflate"), 1),
        "identity body": (_infer(GOOD, content_encoding="identity"), 1),
        "brotli body": (_infer(GOOD, content_encoding="br"), 1),
        "gzip body, not gzip": (_infer(GOOD, content_encoding="gzip"), 1),
        "gzip body, truncated": (_infer(gzip.compress(GOOD)[:-6], content_encoding="gzip"), 1),
        "version 2": (_infer(GOOD, version="2"), 1),
        "version 1 (not served)": (_infer(GOOD, version="1"), 1),
        "version 02": (_infer(GOOD, version="02"), 1),
        "version 0": (_infer(GOOD, version="0"), 1),
        "version empty": (_infer(GOOD, version=""), 1),
        "version not a number": (_infer(GOOD, version="x"), 1),
        "version long": (_infer(GOOD, version="1" * 40), 1),
        "unknown model": (_infer(GOOD, "nope"), 1),
        "unknown model, bad body": (_infer(b"{", "nope"), 1),
        "query string": (
            _request("POST", "/v2/models/mlp/infer?a=1&b", GOOD, {"X-API-Key": KEY}),
            1,
        ),
        "escaped path": (_request("POST", "/v2/models/ml%70/infer", GOOD, {"X-API-Key": KEY}), 1),
        "trailing slash": (_request("POST", "/v2/models/mlp/infer/", GOOD, {"X-API-Key": KEY}), 1),
        "absolute URI": (
            _request("POST", "http://gateway/v2/models/mlp/infer", GOOD, {"X-API-Key": KEY}),
            1,
        ),
        "chunked": (_chunked(_infer(GOOD)), 1),
        "chunked and gzip": (_chunked(_infer(gzip.compress(GOOD), content_encoding="gzip")), 1),
        "HTTP/1.0": (
            _request("POST", "/v2/models/mlp/infer", GOOD, {"X-API-Key": KEY}, http="1.0"),
            1,
        ),
        "connection close": (_infer(GOOD, connection="close"), 1),
        "length with zeros first": (_infer(GOOD, content_length="000" + str(len(GOOD))), 1),
        "length and chunked": (
            _infer(GOOD, transfer_encoding="chunked", content_length=str(len(GOOD))),
            1,
        ),
        "a body at the lane's limit": (_infer(b" " * (65536 - len(GOOD)) + GOOD), 1),
        "a body past the lane's limit": (_infer(b" " * (65537 - len(GOOD)) + GOOD), 1),
        "a body past max_request_mb": (_infer(b" " * 600_000), 1),
        "expect 100-continue": (_infer(GOOD, expect="100-continue"), 2),
        "expect, refused": (_infer(GOOD, "nope", expect="100-continue"), 1),
        "upgrade": (_infer(GOOD, connection="upgrade", upgrade="h2c"), 1),
        "GET infer": (_request("GET", "/v2/models/mlp/infer"), 1),
        "PUT infer": (_request("PUT", "/v2/models/mlp/infer", GOOD), 1),
        "ready": (_request("GET", "/v2/health/ready"), 1),
        "model": (_request("GET", "/v2/models/mlp"), 1),
        "model version": (_request("GET", "/v2/models/mlp/versions/2"), 1),
        "unknown endpoint": (_request("GET", "/v2/nothing"), 1),
        "malformed": (b"POST /v2/models/mlp/infer HTTP/1.1\r\nContent-Length: x\r\n\r\n", 1),
        "pipelined": (
            _infer(GOOD)
            + _request("GET", "/v2/health/ready")
            + _infer(_json({"id": "second", "inputs": [X]}))
            + _infer(b"{bad")
            + _infer(GOOD, "nope")
            + _infer(GOOD, key="wrong")
            + _infer(big, accept_encoding="gzip"),
            7,
        ),
    }
    return c


CORPUS = _corpus()
# Paths served once (a 200) before the corpus, so that a front decodes the corpus's
# requests on them itself (server/front.py): the corpus meets both the front's decoding
# and the engine's.
WARM = [
    _infer(GOOD),
    _infer(GOOD, key=None),
    _infer(GOOD, version="2"),
    _infer(GOOD, version="02"),
    _infer(GOOD, version=""),
    _infer(_json({"inputs": _numbers()}), "numbers"),
    _infer(
        _json(
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                    {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                ]
            }
        ),
        "simple",
    ),
]


@pytest.fixture(scope="module")
def warm(pair: Pair) -> Pair:
    for server in (pair.one, pair.split):
        for request in WARM:
            (answer,) = _exchange(server.port, request)
            assert _status(answer) == 200, answer
    return pair


@pytest.mark.parametrize("case", CORPUS)
def test_fronts_answer_each_request_as_one_process_does(warm: Pair, case: str) -> None:
    request, count = CORPUS[case]
    split = _exchange(warm.split.port, request, count)
    one = _exchange(warm.one.port, request, count)
    assert len(one) == count, one
    assert split == one


def test_the_corpus_meets_what_it_should(warm: Pair) -> None:
    """The corpus is not all refusals: it holds the answers it was written for."""
    statuses = {case: _status(_exchange(warm.one.port, CORPUS[case][0])[0]) for case in CORPUS}
    assert set(statuses.values()) >= {100, 200, 400, 401, 404, 413}
    served = ("plain", "binary every number", "JSON every number", "BYTES", "gzip answer")
    for case in (*served, "INT32 classification", "extremes", "zero rows", "deep parameters"):
        assert statuses[case] == 200, case
    for case in ("escaped shared memory output", "past FP16", "NaN", "header length short"):
        assert statuses[case] == 400, case


def test_a_connection_kept_alive_is_answered_alike(warm: Pair) -> None:
    """Requests one after the other on one connection, each once the answer before it
    came (refusals close nothing): the connection's next request is the lane's again."""
    requests = [CORPUS[c][0] for c in ("plain", "wrong key", "unknown model", "id", "gzip answer")]
    results = []
    for server in (warm.one, warm.split):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            answers = []
            for request in requests:
                sock.sendall(request)
                answers += _answers(sock, 1)
            results.append(answers)
    assert len(results[0]) == len(requests)
    assert results[0] == results[1]


def _read_by_server(server_port: int, client: socket.socket) -> bool:
    """Whether the server has read all that `client` sent it (its socket's receive queue
    in /proc/net/tcp is empty): what it has read, it has parsed."""
    client_port = client.getsockname()[1]
    local, remote = f":{server_port:04X}", f":{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(local) and fields[2].endswith(remote):
            return int(fields[4].split(":")[1], 16) == 0
    return False


def _in_pieces(port: int, request: bytes, size: int = 9) -> list[bytes]:
    """`request` sent its head first, then its body `size` bytes at a time, each once the
    server has read what came before: the lane starts it with its body still to come."""
    head, _, body = request.partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head + b"\r\n\r\n")
        for start in range(0, len(body), size):
            wait_until(lambda: _read_by_server(port, sock), 30, "the server reading")
            sock.sendall(body[start : start + size])
        return _answers(sock, 1)


@pytest.mark.parametrize(
    "case", ["plain", "wrong key", "not an object", "unknown model", "gzip small answer", "id"]
)
def test_a_body_that_comes_in_pieces_is_answered_alike(warm: Pair, case: str) -> None:
    """The lane waits for the rest of a body (with fronts, the front does, and asks the
    engine once it is whole; one process refuses a stranger at the head, the front once
    the body is in, as the README says): the same answer."""
    request = CORPUS[case][0]
    split = _in_pieces(warm.split.port, request)
    assert split == _in_pieces(warm.one.port, request)


def test_a_tenant_over_its_rate_is_refused_alike(warm: Pair) -> None:
    """Its first two requests served, then 429s with the same Retry-After and message,
    whatever the body (a front decodes none of them: see the last tests)."""
    heavy = _json({"inputs": [{**X, "shape": [1000, 4], "data": [0.5] * 4000}]})
    requests = [_infer(GOOD, key=SLOW)] * 2 + [
        _infer(GOOD, key=SLOW),
        _infer(heavy, key=SLOW),
        _infer(b"{", key=SLOW),
        _infer(GOOD, "nope", key=SLOW),
    ]
    one = [_exchange(warm.one.port, r)[0] for r in requests]
    split = [_exchange(warm.split.port, r)[0] for r in requests]
    assert [_status(a) for a in one] == [200, 200, 429, 429, 429, 404]
    assert split == one


def _held(value: int) -> bytes:
    """A request of the tenant with one slot, its call held in the worker until the
    file release-`value` exists (0: not held)."""
    doc = {
        "inputs": [X, {"name": "hold", "datatype": "INT64", "shape": [1, 1], "data": [value]}],
        "outputs": [{"name": "y"}],  # (not its worker's pid)
    }
    return _infer(_json(doc), "held", key=SINGLE)


def _over_concurrency(server: ServerProcess, gates: Path, gate: int) -> list[bytes]:
    """Two served; one held while two more come (429s); its client leaves, its call
    ends, the slot comes back, and one more is served."""
    answers = _exchange(server.port, _held(0)) + _exchange(server.port, _held(0))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as holder:
        holder.sendall(_held(gate))
        wait_until(lambda: holding(gates, gate), 30, "the call held")
        assert _tenant(server, "single")["in_flight"] == 1
        answers += _exchange(server.port, _held(0))  # over its concurrency
        answers += _exchange(server.port, _infer(b"{", "held", key=SINGLE))
    (gates / f"release-{gate}").touch()  # its client has gone; the call ends
    wait_until(lambda: _tenant(server, "single")["in_flight"] == 0, 30, "the slot back")
    return answers + _exchange(server.port, _held(0))


def test_a_tenant_at_its_concurrency_is_refused_alike_and_gets_its_slot_back(
    warm: Pair,
) -> None:
    """One request held in the worker; the tenant's next are 429s, alike; its client
    leaves, the call ends, and the slot is free again (in both, never leaked)."""
    one = _over_concurrency(warm.one, warm.gates, 1)
    split = _over_concurrency(warm.split, warm.gates, 2)
    assert [_status(a) for a in one] == [200, 200, 429, 429, 200]
    assert split == one


def test_a_key_revoked_while_a_front_knows_it_is_refused_alike(warm: Pair) -> None:
    """A key the front has seen served, revoked by a live profile edit: 401s alike
    (decoded by the front or not); given back, served again alike."""
    requests = [_infer(GOOD, key=REVOKED), _infer(b"{", key=REVOKED), _infer(GOOD, key=REVOKED)]

    def keys(count: int) -> bool:
        return all(_tenant(s, "revocable")["keys"] == count for s in (warm.one, warm.split))

    def answers() -> list[list[bytes]]:
        return [[_exchange(s.port, r)[0] for r in requests] for s in (warm.one, warm.split)]

    served = answers()
    assert [_status(a) for a in served[0]] == [200, 400, 200]
    assert served[0] == served[1]
    try:
        for fronts in (0, 1):
            (warm.folder / f"profile-{fronts}.toml").write_text(_profile(fronts, revoked=True))
        wait_until(lambda: keys(0), 30, "the key revoked")
        refused = answers()
        assert [_status(a) for a in refused[0]] == [401, 401, 401]
        assert refused[0] == refused[1]
    finally:
        for fronts in (0, 1):
            (warm.folder / f"profile-{fronts}.toml").write_text(_profile(fronts))
        wait_until(lambda: keys(1), 30, "the key given back")
    again = answers()
    assert again == served


def test_many_clients_at_once_are_answered_alike(warm: Pair) -> None:
    """Concurrent clients (the link carries a step's messages together, the engine
    batches decoded and undecoded requests together): each answer is its own request's,
    as one process gives it."""
    # One answer each, on a connection the next request may use (their answer says
    # whether it closes it): the lane's requests, the ASGI route's, refusals.
    cases = [c for c in CORPUS if CORPUS[c][1] == 1]
    cases = [c for c in cases if not any(w in c for w in ("limit", "max_request", "length "))]
    cases = [c for c in cases if c not in ("malformed", "upgrade", "expect, refused")]
    want = {c: _exchange(warm.one.port, CORPUS[c][0]) for c in cases}

    def client(start: int) -> list[tuple[str, list[bytes]]]:
        got = []
        sock = socket.create_connection(("127.0.0.1", warm.split.port), timeout=30)
        try:
            for step in range(12):
                case = cases[(start * 5 + step * 7) % len(cases)]
                sock.sendall(CORPUS[case][0])
                answer = _answers(sock, 1)
                got.append((case, answer))
                if not answer or b"connection: close" in answer[0]:
                    sock.close()
                    sock = socket.create_connection(("127.0.0.1", warm.split.port), timeout=30)
        finally:
            sock.close()
        return got

    with ThreadPoolExecutor(16) as clients:
        for got in clients.map(client, range(32)):
            for case, answer in got:
                assert answer == want[case], case


# -- what a front decodes: only what the engine would (server/front.py) --------------------


class _Engine:
    """The engine's end of a front's link, played: each request's answer as the test says,
    and whether the front sent it decoded."""

    def __init__(self) -> None:
        self.decoded: list[bool] = []
        self.answers: list[tuple[int, list[tuple[bytes, bytes]]]] = []
        self.end = LinkProtocol(self._on_message)

    def _on_message(self, message: Message) -> None:
        self.decoded.append(message[-1] is not None)
        status, headers = self.answers.pop(0)
        tenant = "-" if status == 401 else "t"
        self.end.send(("reply", message[1], status, headers, b"{}", tenant))


async def _front_and_engine(
    tmp_path: Path,
) -> tuple[ForwardRoute, _Engine, Callable[[], Any]]:
    engine = _Engine()
    path = str(tmp_path / "link.sock")
    server = await asyncio.get_running_loop().create_unix_server(lambda: engine.end, path)
    link = EngineLink()
    await link.connect(path, lambda: None)

    async def close() -> None:
        for end in (link.link, engine.end):
            if end is not None and end.transport is not None:
                end.transport.close()
        server.close()
        await server.wait_closed()

    return ForwardRoute(link, 64 * 1024), engine, close


async def _ask(
    route: ForwardRoute,
    engine: _Engine,
    model: str,
    status: int,
    headers: list[tuple[bytes, bytes]] | None = None,
    key: str = KEY,
    body: bytes = GOOD,
) -> bool:
    """Whether the front sent this request decoded; the engine answers `status`."""
    engine.answers.append((status, headers or []))
    replied: asyncio.Future[Reply | None] = asyncio.get_running_loop().create_future()
    route.answer_now(model, None, [(b"x-api-key", key.encode())], body, replied.set_result)
    reply = await replied
    assert reply is not None
    assert reply.status == status
    return engine.decoded[-1]


async def test_a_front_does_not_decode_for_a_model_the_engine_refuses(tmp_path: Path) -> None:
    """A key served on one model, asking for one that does not exist (404) or that it
    may not use (403): one process refuses it before decoding its body, and the front
    must not decode it either (it did: a 64 KiB body cost the front 2-3 ms a request,
    ten times and more what the refusal costs one process, in other tenants' time)."""
    route, engine, close = await _front_and_engine(tmp_path)
    try:
        assert not await _ask(route, engine, "m", 200), "the key's first request"
        assert await _ask(route, engine, "m", 200), "served on m before: decoded"
        assert not await _ask(route, engine, "nope", 404), "never served on nope"
        assert not await _ask(route, engine, "nope", 404), "refused there"
        assert not await _ask(route, engine, "private", 403)
        assert await _ask(route, engine, "m", 200), "m still decoded"
        assert await _ask(route, engine, "m", 403), "m served before"
        assert not await _ask(route, engine, "m", 200), "refused on m since"
        assert await _ask(route, engine, "m", 200), "served on m again"
    finally:
        await close()


async def test_a_front_does_not_decode_for_a_tenant_told_to_come_back_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant over its rate or concurrency (429, Retry-After: N): one process refuses
    its requests before decoding them, and until then the front does not decode them
    (it did, each: a throttled tenant's flood cost fronts ten times its cost to one
    process). After its Retry-After, the front decodes for it again."""
    import infergate.server.front as front

    now = [1000.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(front, "time", Clock)
    route, engine, close = await _front_and_engine(tmp_path)
    later = [(b"content-type", b"application/json"), (b"retry-after", b"3")]
    try:
        assert not await _ask(route, engine, "m", 200)
        assert await _ask(route, engine, "m", 429, later), "served on m before: decoded"
        assert not await _ask(route, engine, "m", 429, later), "told to come back in 3 s"
        now[0] += 2.5
        assert not await _ask(route, engine, "m", 200), "not yet"
        now[0] += 0.6
        assert await _ask(route, engine, "m", 200), "3 s on"
        assert not await _ask(route, engine, "m", 200, key="other"), "another key's own"
    finally:
        await close()


def test_a_front_does_not_decode_strings_only_to_send_them_as_a_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A BYTES tensor goes to the engine as its body (it decodes it): the front did
    decode it first all the same, a wasted decoding (1.8 ms of a front's time for 64 KiB
    of strings, besides the engine's own)."""
    import infergate.server.predecode as predecode
    from infergate.server.codec import decode_request

    decoded: list[bytes] = []

    def counted(body: Any, header_length: str | None) -> Any:
        decoded.append(bytes(body))
        return decode_request(body, header_length)

    monkeypatch.setattr(predecode, "decode_request", counted)
    strings = _json(
        {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]}
    )
    assert pack(strings, {}, 1 << 20) is None
    assert decoded == []
    assert pack(GOOD, {}, 1 << 20) is not None  # numbers still are
    escaped = strings.replace(b'"BYTES"', b'"BYTE\\u0053"')  # (found by decoding: still refused)
    assert pack(escaped, {}, 1 << 20) is None
    assert decoded == [GOOD, escaped]


def test_the_parity_servers_left_nothing_in_flight(warm: Pair) -> None:
    """After everything above: no tenant holds a slot in either gateway."""
    for server in (warm.one, warm.split):
        doc = httpx.get(f"{server.url}/admin/tenants", timeout=10).json()
        assert {t["name"]: t["in_flight"] for t in doc["tenants"]} == {
            t["name"]: 0 for t in doc["tenants"]
        }
        assert server.process is not None
        assert server.process.poll() is None
