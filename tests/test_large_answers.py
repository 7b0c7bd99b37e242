"""Large answers (server/large_answers.py) finished without holding up the event loop:
compressed on a thread, JSON encoded in slices with the loop serving others between two,
and the same answer as before, byte for byte (once decompressed), on the ASGI route's way
(`InferRoute.reply`) and the lane's (`InferRoute.answer_now`). In-process: an engine
whose worker is a FakeWorker (tests/fake_workers.py), answering what the test says."""

from __future__ import annotations

import asyncio
import gzip
import threading
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.errors import LargeAnswer
from infergate.server import encoding
from infergate.server.codec import DecodedRequest, decode_request
from infergate.server.compression import compress_pieces
from infergate.server.encoding import encode_response
from infergate.server.infer_route import InferRoute
from infergate.server.large_answers import encode_in_slices, finish
from infergate.server.predecode import pack_outputs
from infergate.server.reply import Reply
from infergate.tensors import Array
from tests.fake_workers import FakeWorkers
from tests.polling import eventually
from tests.scripted_runtime import make_scripted

_BODY = orjson.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0.5] * 4}]}
)
_GZIP = [(b"accept-encoding", b"gzip")]
_PLAIN: list[tuple[bytes, bytes]] = []


def _big(elements: int) -> dict[str, Array]:
    """An answer of `elements` FP32 numbers, as the model's one output `y` (one row)."""
    return {"y": np.random.default_rng(7).random((1, elements), dtype=np.float32)}


class LoopSteps:
    """Counts the event loop's steps while it is entered: a task of its own that takes
    one each turn (how many other steps the loop took, counted, not timed)."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopSteps:
        self._task = asyncio.create_task(self._beat())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


def _one_go(outputs: dict[str, Array], request: DecodedRequest, monkeypatch: Any) -> bytes:
    """The answer as `encode_response` writes it in one go (however large)."""
    with monkeypatch.context() as patched:
        patched.setattr(encoding, "AT_ONCE_BYTES", 1 << 62)
        body, _ = encode_response("m", 1, outputs, request)
    return body


def _body_of(reply: Reply) -> bytes:
    """The body as the client reads it: decompressed as its headers say."""
    headers = dict(reply.headers)
    assert int(headers[b"content-length"]) == len(reply.body)
    coding = headers.get(b"content-encoding")
    if coding == b"gzip":
        return gzip.decompress(reply.body)
    if coding == b"deflate":
        return zlib.decompress(reply.body)
    assert coding is None
    return reply.body


async def _no_fallback(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("only infer requests here")


async def _nothing() -> Message:
    raise AssertionError("the body was given whole")


@dataclass
class Gateway:
    route: InferRoute
    workers: FakeWorkers

    async def reply(
        self, headers: list[tuple[bytes, bytes]], outputs: dict[str, Array]
    ) -> asyncio.Task[Reply]:
        """A request on the ASGI route's way whose worker answers `outputs`: its reply's
        task, once the worker has answered."""
        task = asyncio.create_task(self.route.reply("m", None, headers, _nothing, _BODY))
        (await self.workers.next_call()).reply(outputs)
        return task

    async def answer_now(
        self, headers: list[tuple[bytes, bytes]], outputs: dict[str, Array]
    ) -> list[Reply | None]:
        """The same request on the lane's way: what its `respond` is given, when it is."""
        given: list[Reply | None] = []
        waiting = self.route.answer_now("m", None, headers, _BODY, given.append)
        assert isinstance(waiting, asyncio.Future), waiting  # its worker has not answered
        (await self.workers.next_call()).reply(outputs)
        return given


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=(), outputs=("y",))
    workers = FakeWorkers()
    engine = Engine(
        EngineSettings(tmp_path / "models", "explicit"), EngineContext(worker_factory=workers)
    )
    await engine.start()
    await eventually(lambda: engine.ready and engine.version("m").ready, what="m to load")
    yield Gateway(InferRoute(engine, _no_fallback, 64 << 20), workers)
    await engine.stop()


@pytest.fixture
def compression_gate(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[list[bool], threading.Event]]:
    """zlib and gzip, noting for each compression whether it ran on the event loop's
    thread (this one), and holding those that run elsewhere until the gate opens (the
    test then sees what the loop does meanwhile; one on the loop is not held: it would
    hold the loop)."""
    loop_thread = threading.get_ident()
    on_loop: list[bool] = []
    gate = threading.Event()

    def held(real: Callable[..., Any]) -> Callable[..., Any]:
        def compress(*args: Any, **kwargs: Any) -> Any:
            on_loop.append(threading.get_ident() == loop_thread)
            if not on_loop[-1]:
                gate.wait(30)
            return real(*args, **kwargs)

        return compress

    for module, name in ((gzip, "compress"), (zlib, "compress"), (zlib, "compressobj")):
        monkeypatch.setattr(module, name, held(getattr(module, name)))
    yield on_loop, gate
    gate.set()  # (a failed test's thread is not left waiting)


@pytest.mark.parametrize("way", ["reply", "answer_now"])
async def test_a_large_answer_is_compressed_off_the_loop_which_answers_others_meanwhile(
    gateway: Gateway,
    compression_gate: tuple[list[bool], threading.Event],
    monkeypatch: pytest.MonkeyPatch,
    way: str,
) -> None:
    on_loop, gate = compression_gate
    outputs = _big(1 << 18)  # 1 MB of FP32: 2.7 MB of JSON, 40 ms of gzip on the loop
    if way == "reply":
        task = await gateway.reply(_GZIP, outputs)
        done: Callable[[], Reply | None] = lambda: task.result() if task.done() else None  # noqa: E731
    else:
        given = await gateway.answer_now(_GZIP, outputs)
        done = lambda: given[0] if given else None  # noqa: E731
    await eventually(lambda: on_loop, what="the answer's compression to begin")
    # While it is compressed (held at the gate), the loop answers another client.
    other = await gateway.reply(_PLAIN, {"y": np.ones((1, 4), np.float32)})
    assert (await asyncio.wait_for(other, 30)).status == 200
    assert done() is None  # the large one is still being compressed
    gate.set()
    reply = await eventually(done, what="the large answer")
    assert reply.status == 200
    assert dict(reply.headers)[b"content-encoding"] == b"gzip"
    assert _body_of(reply) == _one_go(outputs, decode_request(_BODY, None), monkeypatch)
    assert not any(on_loop), "compressed on the event loop's thread"


async def test_a_large_answer_cancelled_while_it_is_finished_is_answered_none(
    gateway: Gateway, compression_gate: tuple[list[bool], threading.Event]
) -> None:
    """The gateway stopping while a lane request's large answer is compressed: its
    `respond` gets None (the lane answers 503), not nothing."""
    on_loop, gate = compression_gate
    given = await gateway.answer_now(_GZIP, _big(1 << 18))
    await eventually(lambda: on_loop, what="the answer's compression to begin")
    for task in list(gateway.route._finishing):
        task.cancel()
    assert await eventually(lambda: given, what="the answer") == [None]


@pytest.mark.parametrize("way", ["reply", "answer_now"])
async def test_a_large_json_answer_is_encoded_while_the_loop_serves_others(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """Steps of the loop counted by a task of its own from the worker's answer to the
    reply: encoded in one go (4 MB of FP32 as JSON, 11 MB of text), it takes a few;
    in slices, one or more a slice (32 here). Counted, not timed."""
    outputs = _big(1 << 20)
    async with LoopSteps() as steps:
        if way == "reply":
            task = await gateway.reply(_PLAIN, outputs)
            answered = steps.count
            reply = await task
        else:
            given = await gateway.answer_now(_PLAIN, outputs)
            answered = steps.count
            reply = await eventually(lambda: given[0] if given else None, what="the answer")
        assert reply is not None
        during = steps.count - answered
    assert reply.status == 200
    assert reply.body == _one_go(outputs, decode_request(_BODY, None), monkeypatch)
    assert during >= 16, f"the loop took {during} other steps while 4 MB of JSON was encoded"


@pytest.mark.parametrize("accept", [b"gzip", b"deflate", b"identity"])
@pytest.mark.parametrize("elements", [3, 300, 20_000, 300_000], ids=lambda n: f"{n} FP32")
async def test_answers_small_and_large_are_as_before(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, accept: bytes, elements: int
) -> None:
    """From tiny (not compressed) to large (sliced, joined and compressed on a thread),
    on both ways, the same bytes as encode_response writes in one go."""
    outputs = _big(elements)
    want = _one_go(outputs, decode_request(_BODY, None), monkeypatch)
    headers = [(b"accept-encoding", accept)]
    by_reply = await (await gateway.reply(headers, outputs))
    given = await gateway.answer_now(headers, outputs)
    by_lane = await eventually(lambda: given[0] if given else None, what="the answer")
    for reply in (by_reply, by_lane):
        assert reply.status == 200
        assert _body_of(reply) == want
        compressed = dict(reply.headers).get(b"content-encoding")
        assert compressed == (accept if accept != b"identity" and len(want) >= 1024 else None)


async def test_a_large_json_answer_that_is_not_text_is_a_400_naming_its_element(
    gateway: Gateway,
) -> None:
    """A BYTES output sliced (2,048 elements a slice): the error names the element's
    place in the whole output, as in one go."""
    strings = np.array([b"ok"] * 20_000, dtype=object)
    strings[9_000] = b"\xff"
    reply = await (await gateway.reply(_PLAIN, {"y": strings.reshape(1, -1)}))
    assert reply.status == 400
    assert "element 9000 holds bytes that are not UTF-8" in orjson.loads(reply.body)["error"]


# ---- the slices themselves: the same document as orjson writes in one go ----

_RNG = np.random.default_rng(3)
_CASES: dict[str, dict[str, Array]] = {
    "FP32": {"y": _RNG.random((3, 50_000), dtype=np.float32)},
    "FP16": {"y": _RNG.random(70_001).astype(np.float16)},
    "FP64 big-endian": {"y": _RNG.random(30_000).astype(">f8")},
    "not contiguous": {"y": _RNG.random((400, 500), dtype=np.float32).T},
    "INT8 and BOOL": {
        "a": _RNG.integers(-128, 127, 200_000).astype(np.int8),
        "b": _RNG.random(100_000) > 0.5,
    },
    "BYTES": {"s": np.array([f"é{i}".encode() for i in range(40_000)], dtype=object)},
    # Few strings, each longer than a slice: numpy counts 8 bytes an element, which took
    # them for a small answer; \x01 is escaped as \u0001, é is two bytes.
    "BYTES long strings": {
        "s": np.array([b"\x01" * 300_000, "é".encode() * 100_000, b"", b'"'], dtype=object)
    },
    "empty and large": {"e": np.zeros((0, 3), np.float32), "y": _RNG.random(40_000, np.float32)},
    "UINT64": {"u": _RNG.integers(0, 2**64 - 1, 20_000, dtype=np.uint64)},
}


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("binary", ["none", "all", "first", "by default"])
@pytest.mark.parametrize("request_id", [None, 'x"\\é'])
async def test_sliced_answers_are_byte_for_byte_those_of_one_go(
    monkeypatch: pytest.MonkeyPatch, case: str, binary: str, request_id: str | None
) -> None:
    outputs = _CASES[case]
    names = {"none": [], "all": list(outputs), "first": list(outputs)[:1], "by default": []}
    request = DecodedRequest(
        request_id, {}, None, frozenset(names[binary]), binary == "by default", {}
    )
    with monkeypatch.context() as patched:
        patched.setattr(encoding, "AT_ONCE_BYTES", 1 << 62)
        want = encode_response("mé", 7, outputs, request)
    with pytest.raises(LargeAnswer) as large:
        encode_response("mé", 7, outputs, request)
    pieces, json_length = await encode_in_slices(*large.value.args)
    assert (b"".join(pieces), json_length) == want
    assert gzip.decompress(compress_pieces(list(pieces), "gzip")) == want[0]
    assert zlib.decompress(compress_pieces(list(pieces), "deflate")) == want[0]
    assert await finish(pieces, None) == want[0]
    assert pieces == []  # let go of (on the thread, for a large body)


async def test_a_string_longer_than_a_slice_is_encoded_in_pieces() -> None:
    """One 4 MB BYTES element as JSON (24 MB of text, each byte escaped): written in
    pieces, the loop taking other steps between them, not in one orjson call."""
    outputs = {"s": np.array([b"\x01" * (4 << 20)], dtype=object)}
    request = DecodedRequest(None, {}, None, frozenset(), False, {})
    with pytest.raises(LargeAnswer) as large:
        encode_response("m", 1, outputs, request)
    async with LoopSteps() as steps:
        pieces, _ = await encode_in_slices(*large.value.args)
    assert orjson.loads(b"".join(pieces))["outputs"][0]["data"] == ["\x01" * (4 << 20)]
    turns = steps.count
    assert turns >= 16, f"the loop took {turns} other steps while 24 MB of JSON was written"


def test_a_front_leaves_a_large_answer_to_the_engine() -> None:
    """A front encodes the answers of the requests it decoded, on its own loop, in one
    go: a large one is encoded by the engine instead, in slices."""
    request = decode_request(_BODY, None)
    assert pack_outputs("m", 1, _big(1_000), request) is not None
    assert pack_outputs("m", 1, _big(1 << 16), request) is None
    assert pack_outputs("m", 1, {"a": _big(1 << 10)["y"], "b": _big(1 << 14)["y"]}, request) is None
