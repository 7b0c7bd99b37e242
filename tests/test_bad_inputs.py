"""Each bad request gets the right status and an {"error"} that says what is wrong; the
server keeps serving through all of them."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from infergate.client import encode_infer_request
from infergate.tensors import numpy_dtype
from tests.onnx_models import ECHO_TYPES
from tests.server import ServerProcess


def x_input(**overrides: Any) -> dict[str, Any]:
    tensor: dict[str, Any] = {
        "name": "x",
        "datatype": "FP32",
        "shape": [1, 4],
        "data": [1, 2, 3, 4],
    }
    tensor.update(overrides)
    return tensor


JSON = {"Content-Type": "application/json"}
_DEEP_LIST = b"[" * 1000 + b"1" + b"]" * 1000


def _with(**fields: Any) -> bytes:
    """A request for mlp with some fields replaced; a field named with dots is inside one
    (`parameters.timeout`, `outputs[0].parameters`), a shape or data one of x's, and the
    value "DEEP" is a list nested a thousand levels."""
    doc: dict[str, Any] = {"inputs": [x_input()]}
    for where, value in fields.items():
        if where in ("shape", "data", "datatype"):
            doc["inputs"][0][where] = value
        elif where == "binary_data_size":
            doc["inputs"][0]["parameters"] = {where: value}
        elif where == "outputs[0].parameters":
            doc["outputs"] = [{"name": "y", "parameters": value}]
        elif where == "parameters.classification":  # (an output's)
            doc["outputs"] = [{"name": "y", "parameters": {"classification": value}}]
        elif where.startswith("parameters."):
            doc.setdefault("parameters", {})[where.split(".", 1)[1]] = value
        else:
            doc[where] = value
    return orjson.dumps(doc).replace(b'"DEEP"', _DEEP_LIST)


CASES: list[tuple[str, str, bytes, dict[str, str], int, str]] = [
    ("unknown model", "/v2/models/nope/infer", b"{}", JSON, 404, "unknown model: 'nope'"),
    (
        "unknown version",
        "/v2/models/mlp/versions/9/infer",
        b"{}",
        JSON,
        404,
        "no version 9 being served; live versions: 1, 2",
    ),
    ("bad version", "/v2/models/mlp/versions/abc/infer", b"{}", JSON, 400, "positive integer"),
    ("malformed JSON", "/v2/models/mlp/infer", b'{"inputs": [', JSON, 400, "not valid JSON"),
    ("not an object", "/v2/models/mlp/infer", b"[1, 2]", JSON, 400, "JSON object"),
    ("no inputs", "/v2/models/mlp/infer", b'{"inputs": []}', JSON, 400, "non-empty 'inputs'"),
    (
        "missing input",
        "/v2/models/echo/infer",
        orjson.dumps(
            {"inputs": [{"name": "in_FP32", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
        ),
        JSON,
        400,
        "input 'in_BOOL' is missing",
    ),
    (
        "unexpected input",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(), x_input(name="z")]}),
        JSON,
        400,
        "unexpected input 'z'",
    ),
    (
        "more inputs than any model takes",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(name=f"x{i}") for i in range(1025)]}),
        JSON,
        400,
        "request has 1025 inputs; a request has at most 1024",
    ),
    (
        "an input name of megabytes",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(name="\x7f" * 600_000)]}),
        JSON,
        400,
        "inputs[0].name is 600000 characters long",
    ),
    (
        "more outputs than any model has",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input()], "outputs": [{"name": "y"}] * 1025}),
        JSON,
        400,
        "request has 1025 outputs",
    ),
    (
        "an output name too long",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input()], "outputs": [{"name": "y" * 1025}]}),
        JSON,
        400,
        "outputs[0].name is 1025 characters long",
    ),
    (
        "wrong datatype",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(datatype="FP64")]}),
        JSON,
        400,
        "input 'x' has datatype FP64 but model 'mlp' expects FP32",
    ),
    (
        "unknown datatype",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(datatype="FLOAT")]}),
        JSON,
        400,
        "datatype 'FLOAT'; expected one of",
    ),
    (
        "wrong shape",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(shape=[1, 5], data=[1, 2, 3, 4, 5])]}),
        JSON,
        400,
        "input 'x' has shape [1, 5] but model 'mlp' expects [-1, 4]",
    ),
    (
        "wrong rank",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(shape=[4])]}),
        JSON,
        400,
        "expects [-1, 4]",
    ),
    (
        "data length vs shape",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(shape=[2, 4])]}),
        JSON,
        400,
        "has 4 elements of data but shape [2, 4] needs 8",
    ),
    (
        "non-numeric data",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(data=["a", "b", "c", "d"])]}),
        JSON,
        400,
        "non-numeric values",
    ),
    (
        "fractional int",
        "/v2/models/echo/infer",
        orjson.dumps(
            {
                "inputs": [
                    {"name": "in_INT32", "datatype": "INT32", "shape": [1, 2], "data": [1.5, 2]}
                ]
            }
        ),
        JSON,
        400,
        "fractional",
    ),
    (
        "bad shape",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(shape=[1, "4"])]}),
        JSON,
        400,
        "'shape' must be a list of non-negative integers",
    ),
    (
        "no data",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4]}]}),
        JSON,
        400,
        "neither 'data' nor parameters.binary_data_size",
    ),
    (
        "binary size vs shape",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(data=None, parameters={"binary_data_size": 12})]})
        + b"\0" * 12,
        {"Inference-Header-Content-Length": "104"},
        400,
        "has 12 bytes of data but shape [1, 4] of FP32 needs 16",
    ),
    (
        "binary data missing",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input(data=None, parameters={"binary_data_size": 16})]}),
        {"Inference-Header-Content-Length": "104"},
        400,
        "remain",
    ),
    (
        "bad header length",
        "/v2/models/mlp/infer",
        b"{}",
        {"Inference-Header-Content-Length": "999"},
        400,
        "body has only 2 bytes",
    ),
    (
        "unknown output",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input()], "outputs": [{"name": "nope"}]}),
        JSON,
        400,
        "unknown output 'nope' requested from model 'mlp'; it has y",
    ),
    (
        "too large",
        "/v2/models/mlp/infer",
        b"{" + b" " * (2 << 20) + b"}",
        JSON,
        413,
        "over the 1 MB limit",
    ),
    (
        "bad timeout",
        "/v2/models/mlp/infer",
        orjson.dumps({"inputs": [x_input()], "parameters": {"timeout": "soon"}}),
        JSON,
        400,
        "parameters.timeout",
    ),
    ("unknown endpoint", "/v2/nothing/here", b"{}", JSON, 404, "no such endpoint"),
    ("65 dimensions", "/v2/models/mlp/infer", _with(shape=[1] * 65), JSON, 400, "at most 64"),
    (
        "an empty tensor numpy cannot shape",
        "/v2/models/mlp/infer",
        _with(shape=[0, 2**61, 4], data=[]),
        JSON,
        400,
        "more elements than any tensor can hold",
    ),
    # Values nested as deep as JSON is read (a repr of them in the message passed Python's
    # recursion limit: a 500).
    ("a deep id", "/v2/models/mlp/infer", _with(id="DEEP"), JSON, 400, "'id' must be a string"),
    ("a deep shape", "/v2/models/mlp/infer", _with(shape="DEEP"), JSON, 400, "got [[[[...]]]]"),
    (
        "a deep BYTES element",
        "/v2/models/mlp/infer",
        _with(datatype="BYTES", shape=[1], data=["DEEP"]),
        JSON,
        400,
        "element 0 is [[[[...]]]]",
    ),
    # False == 0 and 0.0 == 0 in Python: both passed as Triton's 0 (the default level).
    *[
        (
            f"a priority of {shown}",
            "/v2/models/mlp/infer",
            _with(**{"parameters.priority": value}),
            JSON,
            400,
            f"parameters.priority must be a class name or integer, got {shown}",
        )
        for value, shown in ((False, "False"), (0.0, "0.0"))
    ],  # fmt: skip
    # A version of digits str.isdigit() takes and int() does not, or too many for int().
    ("a superscript version", "/v2/models/mlp/versions/%C2%B2/infer", b"{}", JSON, 400, "positive"),
    (
        "a long version",
        "/v2/models/mlp/versions/" + "1" * 5000 + "/infer",
        b"{}",
        JSON,
        400,
        "positive",
    ),
    *[
        (f"a deep {where}", "/v2/models/mlp/infer", _with(**{where: "DEEP"}), JSON, 400, where)
        for where in (
            "datatype",
            "binary_data_size",
            "parameters.classification",
            "parameters",
            "parameters.timeout",
            "parameters.session",
            "parameters.priority",
            "parameters.sequence_id",
            "parameters.binary_data_output",
            "outputs[0].parameters",
        )
    ],
]


def _fix_header_length(body: bytes, headers: dict[str, str]) -> dict[str, str]:
    """The binary cases name a placeholder length; put the real JSON length in."""
    if headers.get("Inference-Header-Content-Length") == "104":
        json_len = body.index(b"}]}") + 3
        return {"Inference-Header-Content-Length": str(json_len)}
    return headers


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "message"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_request(
    server: ServerProcess,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    message: str,
) -> None:
    response = httpx.post(
        server.url + path, content=body, headers=_fix_header_length(body, headers)
    )
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["error"]


def test_an_unknown_models_name_is_not_echoed_whole(server: ServerProcess) -> None:
    """A 4,000-character name came back whole in the 404 (an attacker's 60 KB one too)."""
    r = httpx.get(f"{server.url}/v2/models/{'n' * 4000}")
    assert r.status_code == 404, r.text
    said = r.json()["error"]
    assert said.startswith("Request for unknown model: 'nnnnnnnnnnnnnnnnnnnnnnnn"), said
    assert "n" * 100 not in said, said  # shown short, as every client value is


@pytest.mark.parametrize("version", ["%C2%B2", "1" * 5000])
@pytest.mark.parametrize("route", ["", "/ready", "/config", "/stats"])
def test_a_bad_version_is_a_400_on_every_route(
    server: ServerProcess, route: str, version: str
) -> None:
    r = httpx.get(f"{server.url}/v2/models/mlp/versions/{version}{route}")
    assert r.status_code == 400, r.text
    assert "model version must be a positive integer" in r.json()["error"]


def test_server_serves_after_every_bad_request(server: ServerProcess) -> None:
    for _, path, body, headers, _, _ in CASES:
        httpx.post(server.url + path, content=body, headers=_fix_header_length(body, headers))
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    response = httpx.post(f"{server.url}/v2/models/mlp/infer", json={"inputs": [x_input()]})
    assert response.status_code == 200


def test_input_checks_hold_for_a_model_already_serving(server: ServerProcess) -> None:
    """Valid input signatures are remembered per version; a different one is still checked."""
    url = f"{server.url}/v2/models/mlp/infer"
    for _ in range(2):
        assert httpx.post(url, json={"inputs": [x_input()]}).status_code == 200
    wrong_shape = httpx.post(url, json={"inputs": [x_input(shape=[1, 5], data=[0] * 5)]})
    assert wrong_shape.status_code == 400
    assert "has shape [1, 5] but model 'mlp' expects [-1, 4]" in wrong_shape.json()["error"]
    wrong_type = httpx.post(url, json={"inputs": [x_input(datatype="FP64")]})
    assert wrong_type.status_code == 400
    assert "has datatype FP64 but model 'mlp' expects FP32" in wrong_type.json()["error"]
    assert httpx.post(url, json={"inputs": [x_input()]}).status_code == 200


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_a_request_of_more_strings_than_the_body_limit_allows_is_a_413(
    server: ServerProcess, binary: bool
) -> None:
    """Each BYTES element is a Python object of about 64 bytes in the gateway and the
    worker, so a body of short strings would take many times its size in memory: a
    request holds at most one per 64 bytes of max_request_mb (1 MB here: 16,384), counted
    from the shapes before any is built. One more is a 413 that says so; the limit itself
    serves."""
    limit = 2**20 // 64
    url = f"{server.url}/v2/models/echo/infer"
    for rows, status in ((limit // 2 + 1, 413), (limit // 2, 200)):
        tensors = {
            f"in_{datatype}": np.zeros((rows, 2), numpy_dtype(datatype))
            for datatype in ECHO_TYPES
            if datatype != "BYTES"
        }
        tensors["in_BYTES"] = np.full((rows, 2), b"a", dtype=object)
        body, headers = encode_infer_request(tensors, binary=binary)
        response = httpx.post(url, content=body, headers=headers, timeout=30)
        assert response.status_code == status, response.text[:300]
        if status == 413:
            error = response.json()["error"]
            assert f"input 'in_BYTES' brings the request to {limit + 2} BYTES elements" in error
            assert f"at most {limit}" in error
            assert "max_request_mb" in error
        else:
            assert len(response.content) > limit * 3


def test_an_error_about_a_long_name_is_short(server: ServerProcess) -> None:
    """A 600,000-character input name (DEL, which repr writes as 4 characters) came back
    in full in the 400, expanded five times: a 30 MB request made a 150 MB answer."""
    body = orjson.dumps({"inputs": [x_input(name="\x7f" * 600_000)]})
    response = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers=JSON)
    assert response.status_code == 400
    assert len(response.content) < 1_000, response.content[:200]
