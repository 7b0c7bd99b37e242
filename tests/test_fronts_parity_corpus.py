"""`[server] fronts`: a client cannot tell a gateway behind a front process from one
process. A broad corpus of requests (valid and invalid V2 JSON of every datatype, binary
tensors, BYTES, classification, compression both ways, keys, versions, odd HTTP, the
routes besides infer) goes to one process and to a gateway with a front on the same
models, and every answer must be byte for byte the same (status line, headers in order,
body; the Date aside): each request on a connection of its own, one after another on a
connection kept alive, with its body in pieces, and from many clients at once. (The pair
of gateways, conftest's `parity_pair`: tests/fronts_parity.py.)"""

from __future__ import annotations

import gzip
import re
import socket
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infergate.tensors import V2_TO_NUMPY
from tests.fronts_parity import (
    GOOD,
    KEY,
    NUMBERS,
    Pair,
    X,
    exchange,
    infer_request,
    json_body,
    numbers_inputs,
    raw_request,
    read_answers,
    status_of,
)
from tests.polling import wait_until

# -- the corpus ---------------------------------------------------------------------------


def _chunked(request: bytes) -> bytes:
    """`request` with its body sent chunked (the ASGI route's, in a front passed on)."""
    head, _, body = request.partition(b"\r\n\r\n")
    head = re.sub(rb"\r\nContent-Length: \d+", b"", head) + b"\r\nTransfer-Encoding: chunked"
    framed = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    return head + b"\r\n\r\n" + framed


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
    json_part = json_body(header)
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
    big = json_body({"inputs": [{**X, "shape": [300, 4], "data": [0.25] * 1200}]})
    strings = {"datatype": "BYTES", "shape": [1, 16]}
    string_doc = {
        "inputs": [
            {"name": "INPUT0", **strings, "data": ["3"] * 16},
            {"name": "INPUT1", **strings, "data": ["1"] * 16},
        ]
    }
    wire0, wire1 = _bytes_wire([b"7"] * 16), _bytes_wire([b"2"] * 16)
    string_header = json_body(
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
    escaped_shm = json_body(
        {"inputs": [X], "outputs": [{"name": "y", "parameters": {"SHM": "nowhere"}}]}
    ).replace(b'"SHM"', b'"shared\\u005fmemory_region"')
    c: dict[str, tuple[bytes, int]] = {
        "plain": (infer_request(GOOD), 1),
        "no key": (infer_request(GOOD, key=None), 1),
        "bearer key": (
            raw_request("POST", "/v2/models/mlp/infer", GOOD, {"Authorization": f"bearer  {KEY} "}),
            1,
        ),
        "key and bearer": (infer_request(GOOD, authorization=f"Bearer {KEY}x"), 1),
        "wrong key": (infer_request(GOOD, key="wrong"), 1),
        "wrong key, bad body": (infer_request(b"{", key="wrong"), 1),
        "blank key": (infer_request(GOOD, key="   "), 1),
        "id": (infer_request(json_body({"id": "abc", "inputs": [X]})), 1),
        "numeric id": (infer_request(json_body({"id": 7, "inputs": [X]})), 1),
        "float id": (infer_request(json_body({"id": 1.5e300, "inputs": [X]})), 1),
        "unicode id": (infer_request(json_body({"id": "é\u2028\x00", "inputs": [X]})), 1),
        "list id": (infer_request(json_body({"id": [1], "inputs": [X]})), 1),
        "binary output": (
            infer_request(json_body({"inputs": [X], "parameters": {"binary_data_output": True}})),
            1,
        ),
        "binary output not bool": (
            infer_request(json_body({"inputs": [X], "parameters": {"binary_data_output": 1}})),
            1,
        ),
        "outputs": (infer_request(json_body({"inputs": [X], "outputs": [{"name": "y"}]})), 1),
        "outputs empty": (infer_request(json_body({"inputs": [X], "outputs": []})), 1),
        "outputs twice": (
            infer_request(json_body({"inputs": [X], "outputs": [{"name": "y"}, {"name": "y"}]})),
            1,
        ),
        "outputs unknown": (
            infer_request(json_body({"inputs": [X], "outputs": [{"name": "z"}]})),
            1,
        ),
        "output binary": (
            infer_request(
                json_body(
                    {"inputs": [X], "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
                )
            ),
            1,
        ),
        "classification": (
            infer_request(
                json_body(
                    {"inputs": [X], "outputs": [{"name": "y", "parameters": {"classification": 2}}]}
                )
            ),
            1,
        ),
        "other output parameter": (
            infer_request(
                json_body({"inputs": [X], "outputs": [{"name": "y", "parameters": {"p": [1]}}]})
            ),
            1,
        ),
        "escaped shared memory output": (infer_request(escaped_shm), 1),
        "shared memory input": (
            infer_request(
                json_body(
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
        "nested data": (infer_request(json_body({"inputs": [{**X, "data": [[1, 2, 3, 4]]}]})), 1),
        "ragged data": (infer_request(json_body({"inputs": [{**X, "data": [[1, 2], [3]]}]})), 1),
        "deep data": (
            infer_request(json_body({"inputs": [{**X, "data": "DEEP"}]}).replace(b'"DEEP"', deep)),
            1,
        ),
        "deep parameters": (
            infer_request(
                json_body({"inputs": [X], "parameters": {"deep": "DEEP"}}).replace(b'"DEEP"', deep)
            ),
            1,
        ),
        "deep output parameters": (
            infer_request(
                json_body(
                    {"inputs": [X], "outputs": [{"name": "y", "parameters": {"deep": "DEEP"}}]}
                ).replace(b'"DEEP"', deep)
            ),
            1,
        ),
        "zero rows": (
            infer_request(json_body({"inputs": [{**X, "shape": [0, 4], "data": []}]})),
            1,
        ),
        "zero rows, huge width": (
            infer_request(json_body({"inputs": [{**X, "shape": [0, 2**40], "data": []}]})),
            1,
        ),
        "scalar": (infer_request(json_body({"inputs": [{**X, "shape": [], "data": [1]}]})), 1),
        "scalar data": (infer_request(json_body({"inputs": [{**X, "shape": [], "data": 1}]})), 1),
        "wrong shape": (infer_request(json_body({"inputs": [{**X, "shape": [2, 2]}]})), 1),
        "wrong datatype": (infer_request(json_body({"inputs": [{**X, "datatype": "FP64"}]})), 1),
        "unknown datatype": (infer_request(json_body({"inputs": [{**X, "datatype": "FLOAT"}]})), 1),
        "two inputs of a name": (infer_request(json_body({"inputs": [X, X]})), 1),
        "unexpected input": (infer_request(json_body({"inputs": [X, {**X, "name": "z"}]})), 1),
        "duplicate keys": (
            infer_request(
                GOOD[:-1] + b',"inputs":[' + json_body({**X, "data": [5, 6, 7, 8]}) + b"]}"
            ),
            1,
        ),
        "NaN": (infer_request(GOOD.replace(b"[1,2,3,4]", b"[NaN,2,3,4]")), 1),
        "Infinity": (infer_request(GOOD.replace(b"[1,2,3,4]", b"[Infinity,2,3,4]")), 1),
        "past FP32": (infer_request(GOOD.replace(b"[1,2,3,4]", b"[1e39,2,3,4]")), 1),
        "past double": (infer_request(GOOD.replace(b"[1,2,3,4]", b"[1e400,2,3,4]")), 1),
        "huge integer": (
            infer_request(GOOD.replace(b"[1,2,3,4]", b"[100000000000000000000000,2,3,4]")),
            1,
        ),
        "true in FP32": (infer_request(GOOD.replace(b"[1,2,3,4]", b"[true,2.5,3,4]")), 1),
        "string in FP32": (infer_request(GOOD.replace(b"[1,2,3,4]", b'["1",2,3,4]')), 1),
        "null in FP32": (infer_request(GOOD.replace(b"[1,2,3,4]", b"[null,2,3,4]")), 1),
        "not UTF-8": (infer_request(b'{"id":"\xff","inputs":[' + json_body(X) + b"]}"), 1),
        "lone surrogate": (infer_request(b'{"id":"\\ud800","inputs":[' + json_body(X) + b"]}"), 1),
        "BOM": (infer_request(b"\xef\xbb\xbf" + GOOD), 1),
        "empty body": (infer_request(b""), 1),
        "not an object": (infer_request(b"[1]"), 1),
        "no inputs": (infer_request(b'{"inputs":[]}'), 1),
        "timeout": (
            infer_request(json_body({"inputs": [X], "parameters": {"timeout": 60_000_000}})),
            1,
        ),
        "bad timeout": (
            infer_request(json_body({"inputs": [X], "parameters": {"timeout": -1}})),
            1,
        ),
        "bad priority": (
            infer_request(json_body({"inputs": [X], "parameters": {"priority": "high"}})),
            1,
        ),
        "bad sequence": (
            infer_request(json_body({"inputs": [X], "parameters": {"sequence_id": [1]}})),
            1,
        ),
        "header length": (infer_request(GOOD, inference_header_content_length=str(len(GOOD))), 1),
        "header length spaced": (
            infer_request(GOOD, inference_header_content_length=f" {len(GOOD)} "),
            1,
        ),
        "header length short": (
            infer_request(GOOD, inference_header_content_length=str(len(GOOD) - 1)),
            1,
        ),
        "header length long": (
            infer_request(GOOD, inference_header_content_length=str(len(GOOD) + 1)),
            1,
        ),
        "header length negative": (infer_request(GOOD, inference_header_content_length="-1"), 1),
        "header length huge": (infer_request(GOOD, inference_header_content_length="9" * 30), 1),
        "header length not ASCII": (infer_request(GOOD, inference_header_content_length="\xb9"), 1),
        "header length 0": (infer_request(GOOD, inference_header_content_length="0"), 1),
        "binary every number": (
            infer_request(binary, "numbers", inference_header_content_length=length),
            1,
        ),
        "binary every number, binary out": (
            infer_request(binary_out, "numbers", inference_header_content_length=length_out),
            1,
        ),
        "binary unclaimed bytes": (
            infer_request(binary + b"x", "numbers", inference_header_content_length=length),
            1,
        ),
        "binary too few bytes": (
            infer_request(binary[:-1], "numbers", inference_header_content_length=length),
            1,
        ),
        "JSON every number": (
            infer_request(json_body({"inputs": numbers_inputs(2)}), "numbers"),
            1,
        ),
        "JSON every number, zero rows": (
            infer_request(json_body({"inputs": numbers_inputs(0)}), "numbers"),
            1,
        ),
        "JSON every number, binary out": (
            infer_request(
                json_body(
                    {"inputs": numbers_inputs(3), "parameters": {"binary_data_output": True}}
                ),
                "numbers",
            ),
            1,
        ),
        "JSON some outputs": (
            infer_request(
                json_body(
                    {
                        "inputs": numbers_inputs(),
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
            infer_request(
                json_body(
                    {
                        "inputs": numbers_inputs(
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
        "past INT8": (
            infer_request(
                json_body({"inputs": numbers_inputs(INT8={"data": [128, 0]})}), "numbers"
            ),
            1,
        ),
        "past UINT64": (
            infer_request(
                json_body({"inputs": numbers_inputs(UINT64={"data": [2**64 - 1, 0]})}), "numbers"
            ),
            1,
        ),
        "past FP16": (
            infer_request(
                json_body({"inputs": numbers_inputs(FP16={"data": [65520, 0]})}), "numbers"
            ),
            1,
        ),
        "fraction in INT32": (
            infer_request(
                json_body({"inputs": numbers_inputs(INT32={"data": [1.5, 0]})}), "numbers"
            ),
            1,
        ),
        "integers in BOOL": (
            infer_request(json_body({"inputs": numbers_inputs(BOOL={"data": [1, 0]})}), "numbers"),
            1,
        ),
        "BOOL in INT16": (
            infer_request(
                json_body({"inputs": numbers_inputs(INT16={"data": [True, False]})}), "numbers"
            ),
            1,
        ),
        "BYTES": (infer_request(json_body(string_doc), "simple_string"), 1),
        "BYTES binary": (
            infer_request(
                string_header + wire0 + wire1,
                "simple_string",
                inference_header_content_length=str(len(string_header)),
            ),
            1,
        ),
        "BYTES binary out": (
            infer_request(
                json_body({**string_doc, "parameters": {"binary_data_output": True}}),
                "simple_string",
            ),
            1,
        ),
        "BYTES as numbers": (
            infer_request(json_body({"inputs": simple["inputs"]}), "simple_string"),
            1,
        ),
        "numbers as BYTES": (
            infer_request(json_body({"inputs": string_doc["inputs"]}), "simple"),
            1,
        ),
        "INT32 classification": (
            infer_request(
                json_body(
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
            infer_request(
                json_body(
                    {
                        **simple,
                        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": -1}}],
                    }
                ),
                "simple",
            ),
            1,
        ),
        "gzip answer": (infer_request(big, accept_encoding="gzip"), 1),
        "deflate answer": (infer_request(big, accept_encoding="deflate"), 1),
        "gzip refused": (infer_request(big, accept_encoding="gzip;q=0, br"), 1),
        "gzip asked, upper case": (infer_request(big, accept_encoding="GZIP;q=0.5"), 1),
        "gzip asked, bad q": (infer_request(big, accept_encoding="gzip;q=x, deflate"), 1),
        "gzip binary answer": (
            infer_request(
                big.replace(b'{"inputs"', b'{"parameters":{"binary_data_output":true},"inputs"'),
                accept_encoding="gzip",
            ),
            1,
        ),
        "gzip small answer": (infer_request(GOOD, accept_encoding="gzip"), 1),
        "gzip error": (infer_request(b"{", accept_encoding="gzip"), 1),
        "gzip body": (infer_request(gzip.compress(GOOD), content_encoding="gzip"), 1),
        "deflate body": (infer_request(zlib.compress(GOOD), content_encoding="deflate"), 1),
        "identity body": (infer_request(GOOD, content_encoding="identity"), 1),
        "brotli body": (infer_request(GOOD, content_encoding="br"), 1),
        "gzip body, not gzip": (infer_request(GOOD, content_encoding="gzip"), 1),
        "gzip body, truncated": (
            infer_request(gzip.compress(GOOD)[:-6], content_encoding="gzip"),
            1,
        ),
        "version 2": (infer_request(GOOD, version="2"), 1),
        "version 1 (not served)": (infer_request(GOOD, version="1"), 1),
        "version 02": (infer_request(GOOD, version="02"), 1),
        "version 0": (infer_request(GOOD, version="0"), 1),
        "version empty": (infer_request(GOOD, version=""), 1),
        "version not a number": (infer_request(GOOD, version="x"), 1),
        "version long": (infer_request(GOOD, version="1" * 40), 1),
        "unknown model": (infer_request(GOOD, "nope"), 1),
        "unknown model, bad body": (infer_request(b"{", "nope"), 1),
        "query string": (
            raw_request("POST", "/v2/models/mlp/infer?a=1&b", GOOD, {"X-API-Key": KEY}),
            1,
        ),
        "escaped path": (
            raw_request("POST", "/v2/models/ml%70/infer", GOOD, {"X-API-Key": KEY}),
            1,
        ),
        "trailing slash": (
            raw_request("POST", "/v2/models/mlp/infer/", GOOD, {"X-API-Key": KEY}),
            1,
        ),
        "absolute URI": (
            raw_request("POST", "http://gateway/v2/models/mlp/infer", GOOD, {"X-API-Key": KEY}),
            1,
        ),
        "chunked": (_chunked(infer_request(GOOD)), 1),
        "chunked and gzip": (
            _chunked(infer_request(gzip.compress(GOOD), content_encoding="gzip")),
            1,
        ),
        "HTTP/1.0": (
            raw_request("POST", "/v2/models/mlp/infer", GOOD, {"X-API-Key": KEY}, http="1.0"),
            1,
        ),
        "connection close": (infer_request(GOOD, connection="close"), 1),
        "length with zeros first": (infer_request(GOOD, content_length="000" + str(len(GOOD))), 1),
        "length and chunked": (
            infer_request(GOOD, transfer_encoding="chunked", content_length=str(len(GOOD))),
            1,
        ),
        "a body at the lane's limit": (infer_request(b" " * (65536 - len(GOOD)) + GOOD), 1),
        "a body past the lane's limit": (infer_request(b" " * (65537 - len(GOOD)) + GOOD), 1),
        "a body past max_request_mb": (infer_request(b" " * 600_000), 1),
        "expect 100-continue": (infer_request(GOOD, expect="100-continue"), 2),
        "expect, refused": (infer_request(GOOD, "nope", expect="100-continue"), 1),
        "upgrade": (infer_request(GOOD, connection="upgrade", upgrade="h2c"), 1),
        "GET infer": (raw_request("GET", "/v2/models/mlp/infer"), 1),
        "PUT infer": (raw_request("PUT", "/v2/models/mlp/infer", GOOD), 1),
        "ready": (raw_request("GET", "/v2/health/ready"), 1),
        "model": (raw_request("GET", "/v2/models/mlp"), 1),
        "model version": (raw_request("GET", "/v2/models/mlp/versions/2"), 1),
        "unknown endpoint": (raw_request("GET", "/v2/nothing"), 1),
        "malformed": (b"POST /v2/models/mlp/infer HTTP/1.1\r\nContent-Length: x\r\n\r\n", 1),
        "pipelined": (
            infer_request(GOOD)
            + raw_request("GET", "/v2/health/ready")
            + infer_request(json_body({"id": "second", "inputs": [X]}))
            + infer_request(b"{bad")
            + infer_request(GOOD, "nope")
            + infer_request(GOOD, key="wrong")
            + infer_request(big, accept_encoding="gzip"),
            7,
        ),
    }
    return c


CORPUS = _corpus()


@pytest.mark.parametrize("case", CORPUS)
def test_fronts_answer_each_request_as_one_process_does(parity_pair: Pair, case: str) -> None:
    request, count = CORPUS[case]
    split = exchange(parity_pair.split.port, request, count)
    one = exchange(parity_pair.one.port, request, count)
    assert len(one) == count, one
    assert split == one


def test_the_corpus_meets_what_it_should(parity_pair: Pair) -> None:
    """The corpus is not all refusals: it holds the answers it was written for."""
    statuses = {
        case: status_of(exchange(parity_pair.one.port, CORPUS[case][0])[0]) for case in CORPUS
    }
    assert set(statuses.values()) >= {100, 200, 400, 401, 404, 413}
    served = ("plain", "binary every number", "JSON every number", "BYTES", "gzip answer")
    for case in (*served, "INT32 classification", "extremes", "zero rows", "deep parameters"):
        assert statuses[case] == 200, case
    for case in ("escaped shared memory output", "past FP16", "NaN", "header length short"):
        assert statuses[case] == 400, case


def test_a_connection_kept_alive_is_answered_alike(parity_pair: Pair) -> None:
    """Requests one after the other on one connection, each once the answer before it
    came (refusals close nothing): the connection's next request is the lane's again."""
    requests = [CORPUS[c][0] for c in ("plain", "wrong key", "unknown model", "id", "gzip answer")]
    results = []
    for server in (parity_pair.one, parity_pair.split):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            answers = []
            for request in requests:
                sock.sendall(request)
                answers += read_answers(sock, 1)
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
        return read_answers(sock, 1)


@pytest.mark.parametrize(
    "case", ["plain", "wrong key", "not an object", "unknown model", "gzip small answer", "id"]
)
def test_a_body_that_comes_in_pieces_is_answered_alike(parity_pair: Pair, case: str) -> None:
    """The lane waits for the rest of a body (with fronts, the front does, and asks the
    engine once it is whole; one process refuses a stranger at the head, the front once
    the body is in, as the README says): the same answer."""
    request = CORPUS[case][0]
    split = _in_pieces(parity_pair.split.port, request)
    assert split == _in_pieces(parity_pair.one.port, request)


def test_many_clients_at_once_are_answered_alike(parity_pair: Pair) -> None:
    """Concurrent clients (the link carries a step's messages together, the engine
    batches decoded and undecoded requests together): each answer is its own request's,
    as one process gives it."""
    # One answer each, on a connection the next request may use (their answer says
    # whether it closes it): the lane's requests, the ASGI route's, refusals.
    cases = [c for c in CORPUS if CORPUS[c][1] == 1]
    cases = [c for c in cases if not any(w in c for w in ("limit", "max_request", "length "))]
    cases = [c for c in cases if c not in ("malformed", "upgrade", "expect, refused")]
    want = {c: exchange(parity_pair.one.port, CORPUS[c][0]) for c in cases}

    def client(start: int) -> list[tuple[str, list[bytes]]]:
        got = []
        sock = socket.create_connection(("127.0.0.1", parity_pair.split.port), timeout=30)
        try:
            for step in range(12):
                case = cases[(start * 5 + step * 7) % len(cases)]
                sock.sendall(CORPUS[case][0])
                answer = read_answers(sock, 1)
                got.append((case, answer))
                if not answer or b"connection: close" in answer[0]:
                    sock.close()
                    sock = socket.create_connection(
                        ("127.0.0.1", parity_pair.split.port), timeout=30
                    )
        finally:
            sock.close()
        return got

    with ThreadPoolExecutor(16) as clients:
        for got in clients.map(client, range(32)):
            for case, answer in got:
                assert answer == want[case], case
