"""A front's decoding of the lane's usual request (server/predecode.py): what the engine
rebuilds from the link is what it would have decoded itself, what the front must not
decode goes as its body alone, and a front decodes only for a key the engine accepted
(server/front.py; the engine's side of the link is played here, over a real socket)."""

from __future__ import annotations

import asyncio
import marshal
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from infergate.client import encode_infer_request
from infergate.server.codec import DecodedRequest, decode_request
from infergate.server.compression import compress_response
from infergate.server.encoding import encode_response
from infergate.server.front import EngineLink, ForwardRoute
from infergate.server.link import LinkProtocol, Message
from infergate.server.predecode import encode_answer, pack, pack_outputs, unpack
from infergate.server.reply import Reply
from infergate.tensors import V2_TO_NUMPY, Array

LIMIT = 64 * 1024


def _through_the_link(body: bytes, headers: dict[bytes, bytes]) -> DecodedRequest | None:
    both = pack(body, headers, LIMIT)
    return None if both is None else unpack(marshal.loads(marshal.dumps(both[1])))


def _same(got: DecodedRequest, want: DecodedRequest) -> None:
    assert got._replace(inputs={}) == want._replace(inputs={})
    assert list(got.inputs) == list(want.inputs)
    for name, array in want.inputs.items():
        assert got.inputs[name].dtype == array.dtype
        assert got.inputs[name].shape == array.shape
        assert np.array_equal(got.inputs[name], array)


@pytest.mark.parametrize("datatype", [d for d in V2_TO_NUMPY if d != "BYTES"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_every_number_type_arrives_as_the_engine_would_decode_it(
    datatype: str, binary: bool
) -> None:
    x = np.arange(6).reshape(2, 3).astype(V2_TO_NUMPY[datatype])
    body, headers = encode_infer_request(
        {"x": x}, outputs=["y"], binary=binary, request_id="r-1", parameters={"p": binary}
    )
    raw = {k.lower().encode(): v.encode() for k, v in headers.items()}
    length = raw.get(b"inference-header-content-length")
    want = decode_request(body, None if length is None else length.decode())
    got = _through_the_link(body, raw)
    assert got is not None
    _same(got, want)


def test_parameters_and_output_options_arrive_whole() -> None:
    doc = {
        "id": 7,
        "parameters": {"priority": 1, "deep": "DEEP", "list": [1, "two", None, 3.5]},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 1]}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True, "classification": 2}}],
    }
    # As deep as orjson reads (1,024 levels in all): within what marshal carries (2,000).
    deep = b'{"a":' * 1021 + b"1" + b"}" * 1021
    body = orjson.dumps(doc).replace(b'"DEEP"', deep)
    got = _through_the_link(body, {})
    assert got is not None
    level, depth = got.parameters.pop("deep"), 0
    while isinstance(level, dict):  # (== on it would pass Python's recursion limit)
        level, depth = level["a"], depth + 1
    assert (level, depth) == (1, 1021)
    want = decode_request(body, None)
    want.parameters.pop("deep")
    _same(got, want)
    assert got.id == "7"
    assert got.binary_outputs == frozenset({"y"})
    assert got.output_parameters == {"y": {"binary_data": True, "classification": 2}}


def test_what_the_engine_must_decode_goes_as_its_body() -> None:
    ok = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    )
    assert pack(ok, {}, LIMIT) is not None
    strings = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}
    )
    shared = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, 2],
                    "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8},
                }
            ]
        }
    )
    refused = {
        "not JSON (the engine answers 400, after its own checks)": (b"{nope", {}),
        "no inputs": (b"{}", {}),
        "a header that is not a number": (ok, {b"inference-header-content-length": b"x"}),
        "BYTES": (strings, {}),
        "shared memory (registered in the engine)": (shared, {}),
        "compressed": (ok, {b"content-encoding": b"gzip"}),
    }
    for why, (body, headers) in refused.items():
        assert pack(body, headers, LIMIT) is None, why
    assert pack(ok, {}, len(ok) - 1) is None, "past the size limit (the engine answers 413)"


def test_the_engine_gets_arrays_without_a_copy() -> None:
    body = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]}]}
    )
    both = pack(body, {}, LIMIT)
    assert both is not None
    array = unpack(both[1]).inputs["x"]
    assert array.base is not None
    assert not array.flags.owndata
    assert array.tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("options", "accept"),
    [
        ({}, None),
        ({"id": "r-1", "parameters": {"binary_data_output": True}}, None),
        ({"outputs": [{"name": "b", "parameters": {"binary_data": True}}, {"name": "a"}]}, None),
        ({}, "gzip"),  # a large answer, compressed as the client asks
    ],
    ids=["json", "binary", "some-binary", "gzip"],
)
def test_a_front_encodes_the_answer_as_the_engine_would(
    options: dict[str, Any], accept: str | None
) -> None:
    rows = 600 if accept else 2  # (compressed from compression.MIN_BYTES)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}
    decoded = decode_request(orjson.dumps({**doc, **options}), None)
    outputs: dict[str, Array] = {
        "a": np.linspace(0, 1, rows * 3, dtype=np.float32).reshape(rows, 3),
        "b": np.arange(rows, dtype=np.int64),
    }
    request_headers = [] if accept is None else [(b"accept-encoding", accept.encode())]
    packed = pack_outputs("m", 3, outputs, decoded)
    assert packed is not None
    headers, body = encode_answer(marshal.loads(marshal.dumps(packed)), decoded, request_headers)
    # The engine's own: its body, content type and compression (server/infer_route.py).
    want_body, json_length = encode_response("m", 3, outputs, decoded)
    want_headers = (
        [(b"content-type", b"application/json")]
        if json_length is None
        else [
            (b"content-type", b"application/octet-stream"),
            (b"inference-header-content-length", b"%d" % json_length),
        ]
    )
    want_body = compress_response(request_headers, want_headers, want_body, 200)
    want_headers.append((b"content-length", b"%d" % len(want_body)))
    assert (headers, body) == (want_headers, want_body)
    assert (accept is not None) == ((b"content-encoding", b"gzip") in headers)


def test_what_only_the_engine_encodes_comes_finished() -> None:
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}
    plain = decode_request(orjson.dumps(doc), None)
    classified = decode_request(
        orjson.dumps({**doc, "outputs": [{"name": "a", "parameters": {"classification": 2}}]}),
        None,
    )
    numbers: dict[str, Array] = {"a": np.ones((1, 3), np.float32)}
    assert pack_outputs("m", 1, numbers, plain) is not None
    assert pack_outputs("m", 1, numbers, classified) is None
    strings: dict[str, Array] = {"a": np.array([b"text"], dtype=object)}
    assert pack_outputs("m", 1, strings, plain) is None
    swapped: dict[str, Array] = {"a": np.ones(3, np.dtype(np.float32).newbyteorder())}
    assert pack_outputs("m", 1, swapped, plain) is None


async def test_a_front_decodes_only_for_a_key_the_engine_has_accepted(tmp_path: Path) -> None:
    """A stranger's request goes to the engine undecoded (its 401 costs no decoding, as in
    one process); a key the engine accepted is decoded in the front, until it refuses it."""
    asked: list[Message] = []
    answers: list[tuple[int, str]] = []  # the engine's status and tenant for each request

    def engine_side(message: Message) -> None:
        asked.append(message)
        status, tenant = answers.pop(0)
        engine.send(("reply", message[1], status, [], b"{}", tenant))

    engine = LinkProtocol(engine_side)
    path = str(tmp_path / "link.sock")
    server = await asyncio.get_running_loop().create_unix_server(lambda: engine, path)
    link = EngineLink()
    await link.connect(path, lambda: None)
    route = ForwardRoute(link, LIMIT)
    body = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    )

    async def ask(key: str | None, status: int, tenant: str) -> bool:
        """Whether the front sent the request decoded."""
        answers.append((status, tenant))
        headers = [] if key is None else [(b"x-api-key", key.encode())]
        replied: asyncio.Future[Reply | None] = asyncio.get_running_loop().create_future()
        route.answer_now("m", None, headers, body, replied.set_result)
        reply = await replied
        assert reply is not None
        assert reply.status == status
        return asked[-1][-1] is not None

    try:
        assert not await ask("stranger", 401, "-")
        assert not await ask("stranger", 401, "-"), "refused: still a stranger"
        assert not await ask("team-a", 200, "a"), "the first request of a key"
        assert await ask("team-a", 429, "a"), "accepted before: decoded"
        assert await ask("team-a", 401, "-"), "revoked since (a reload)"
        assert not await ask("team-a", 200, "a"), "forgotten once refused"
        assert not await ask(None, 200, "default")
        assert await ask(None, 200, "default"), "no key, where the engine admits one"
    finally:
        for end in (link.link, engine):
            if end is not None and end.transport is not None:
                end.transport.close()
        server.close()
        await server.wait_closed()
