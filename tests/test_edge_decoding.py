"""Large bodies decode off the event loop (server/decoding.py) to the same tensors as small
ones decode inline, whichever way they go: the helper process for JSON, slices on the loop
for binary BYTES. The helper starts with the first large JSON body, not with the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.context
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil
import pytest

from infergate.client import encode_infer_request
from infergate.errors import BadRequest, InfergateError, PayloadTooLarge
from infergate.server.codec import JSON_VALUES_SLACK, DecodedRequest, decode_request
from infergate.server.decoding import HELPER_NAME, BodyDecoder, json_tokens
from infergate.tensors import Array
from tests.conftest import write_profile
from tests.polling import eventually, process_gone, wait_until
from tests.scripted_runtime import make_scripted
from tests.server import ServerProcess

TENSORS: dict[str, Array] = {
    "f": np.arange(12, dtype=np.float32).reshape(3, 4),
    "i": np.array([[-(2**40), 7]], dtype=np.int64),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "s": np.array([[b"\xff\x00", b"", "caf\u00e9".encode()]], dtype=object),
}


def _decode_both(body: bytes, header_length: str | None) -> tuple[DecodedRequest, DecodedRequest]:
    async def large() -> DecodedRequest:
        decoder = BodyDecoder(inline_max_bytes=16)  # everything counts as large
        try:
            return await decoder.decode(body, header_length)
        finally:
            decoder.close()

    return decode_request(body, header_length), asyncio.run(large())


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_large_body_decodes_to_what_a_small_one_does(binary: bool) -> None:
    tensors = dict(TENSORS)
    if not binary:  # JSON strings are text
        tensors["s"] = np.array([["caf\u00e9".encode(), b"", b"x"]], dtype=object)
    body, headers = encode_infer_request(tensors, outputs=["y"], binary=binary)
    inline, large = _decode_both(body, headers.get("Inference-Header-Content-Length"))
    assert list(large.inputs) == list(inline.inputs) == list(tensors)
    for name, array in inline.inputs.items():
        assert large.inputs[name].dtype == array.dtype
        assert large.inputs[name].shape == array.shape
        assert large.inputs[name].tolist() == array.tolist()
    assert large._replace(inputs={}) == inline._replace(inputs={})


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_large_body_of_too_many_strings_is_refused_before_they_are_built(binary: bool) -> None:
    """The BYTES element limit holds on the large bodies' ways too: the helper (JSON) and
    the slices on the loop (binary) refuse by the shapes, with a 413."""

    async def large(body: bytes, length: str | None) -> DecodedRequest:
        decoder = BodyDecoder(inline_max_bytes=16, max_strings=4)
        try:
            return await decoder.decode(body, length)
        finally:
            decoder.close()

    two = {"s": np.array([[b"a", b"b"]], dtype=object)}
    five = {**two, "t": np.array([[b"x", b"y", b"z"]], dtype=object)}
    for tensors, refused in ((two, False), (five, True)):
        body, headers = encode_infer_request(tensors, binary=binary)
        length = headers.get("Inference-Header-Content-Length")
        if not refused:
            assert asyncio.run(large(body, length)).inputs["s"].tolist() == [[b"a", b"b"]]
            continue
        with pytest.raises(PayloadTooLarge, match="input 't' brings the request to 5 BYTES"):
            asyncio.run(large(body, length))


def test_a_large_body_with_bad_bytes_is_a_400_either_way() -> None:
    body, headers = encode_infer_request({"s": TENSORS["s"]}, binary=True)
    length = headers["Inference-Header-Content-Length"]
    cut = body[:-1]
    with pytest.raises(BadRequest):
        decode_request(cut, length)
    with pytest.raises(BadRequest, match="input 's'"):
        _decode_both(cut, length)


@pytest.mark.parametrize("written", ["+{n}", " {n}", "{n} ", "0_{n}", "\u0661{n}"])
def test_a_header_length_other_than_digits_is_a_400_before_any_decoding(written: str) -> None:
    """int() takes these; the body decoder, reading digits, took them for no length and
    decoded a large JSON body on the event loop (40 MB: health answers 650 ms late)."""
    body, _ = encode_infer_request({"f": TENSORS["f"]}, binary=False)
    length = written.format(n=len(body))
    with pytest.raises(BadRequest, match="in digits"):
        decode_request(body, length)
    with pytest.raises(BadRequest, match="in digits"):
        _decode_both(body, length)


def test_a_helper_that_cannot_start_fails_that_request_and_the_next_tries_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper that cannot start (EAGAIN: the process limit) fails the request in hand
    with an InfergateError naming why (a 500 the client may retry), and the next large body
    starts a helper again."""
    body, _ = encode_infer_request({"f": TENSORS["f"]}, binary=False)

    async def twice() -> DecodedRequest:
        decoder = BodyDecoder(inline_max_bytes=16)
        try:
            with monkeypatch.context() as patched:
                patched.setattr(
                    multiprocessing.context.SpawnProcess,
                    "start",
                    lambda self: (_ for _ in ()).throw(BlockingIOError(11, "no more processes")),
                )
                with pytest.raises(InfergateError, match="could not start .*no more processes"):
                    await decoder.decode(body, None)
            return await decoder.decode(body, None)
        finally:
            decoder.close()

    assert asyncio.run(twice()).inputs["f"].tolist() == TENSORS["f"].tolist()


def _spawned_children(gateway: int) -> list[psutil.Process]:
    """The gateway's children that multiprocessing spawned: the decoding helper is the only
    one (workers are forked from the fork server), whatever name it has taken yet."""
    found = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(gateway).children():
            with contextlib.suppress(psutil.Error):
                if "multiprocessing.spawn" in " ".join(child.cmdline()):
                    found.append(child)
    return found


def test_the_helper_starts_with_the_first_large_json_body_and_ends_with_the_gateway(
    tmp_path: Path,
) -> None:
    """A gateway that never gets a large JSON body never pays for the helper (0.25 s of
    CPU and 54 MB each); the first such body starts it, niced and named, and it still ends
    with a gateway killed outright (SIGKILL, the OOM killer)."""
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=(), width=1024)
    profile = write_profile(tmp_path, "[server]\nmax_request_mb = 8\n")
    server = ServerProcess(tmp_path / "models", profile, tmp_path / "log").start()
    assert server.process is not None
    gateway = server.process.pid
    url = f"{server.url}/v2/models/m/infer"

    def infer(rows: int) -> httpx.Response:
        x = {"name": "x", "datatype": "FP32", "shape": [rows, 1024], "data": [0.5] * (rows * 1024)}
        return httpx.post(url, json={"inputs": [x]}, timeout=60)

    try:
        wait_until(lambda: server.model("m")["state"] == "ready", what="the model")
        assert infer(2).status_code == 200  # a small body decodes inline
        assert _spawned_children(gateway) == []
        answer = infer(512)  # 2 MB of JSON: past the inline limit
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["shape"] == [512, 1024]
        (helper,) = _spawned_children(gateway)  # it has run its start-up: it decoded the body
        assert helper.nice() == 5
        assert helper.name() == HELPER_NAME.decode()
        server.process.kill()
        server.process.wait()
        wait_until(lambda: process_gone(helper.pid), what="the helper to end with the gateway")
    finally:
        server.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gateway, signal.SIGKILL)  # (its session: whatever is left in it)


def test_a_decode_cancelled_before_its_tensors_are_read_leaves_no_segment_behind() -> None:
    """A client that leaves cancels its decode (server/departure.py): cancelled while the
    read of the helper's output waits on the I/O thread (behind another request's write),
    the read never ran, and its segment stayed in /dev/shm for good."""

    def segments() -> set[str]:
        return {p for p in os.listdir("/dev/shm") if p.startswith("infergate-decode-")}

    async def scenario() -> set[str]:
        before = segments()
        decoder = BodyDecoder(inline_max_bytes=16)
        body, _ = encode_infer_request({"f": TENSORS["f"]}, outputs=["y"], binary=False)
        io_busy = threading.Event()
        original = decoder._call_helper

        async def call_helper(*args: object, **kwargs: object) -> object:
            decoded: object = await original(*args, **kwargs)  # type: ignore[arg-type]
            decoder._io_thread().submit(io_busy.wait)  # the read queues behind this
            return decoded

        decoder._call_helper = call_helper  # type: ignore[method-assign,assignment]
        try:
            decoding = asyncio.ensure_future(decoder.decode(body, None))
            await eventually(lambda: decoder._io_thread()._work_queue.qsize() >= 1)
            decoding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await decoding
            io_busy.set()
        finally:
            decoder.close()  # waits for the I/O thread's queue
        return segments() - before

    assert asyncio.run(scenario()) == set()


def test_what_decodes_on_the_loop_is_what_decodes_fast_not_only_what_is_small() -> None:
    """A JSON byte's decoding cost varies 30 times over: nested rows or strings of a few
    hundred KB took 26-42 ms of the loop, one client's such bodies holding every tenant's
    requests. They go to the helper, as large bodies do; flat numbers stay on the loop."""
    decoder = BodyDecoder()

    def body(data: str, datatype: str = "FP32") -> bytes:
        tensor = f'{{"name":"x","shape":[1],"datatype":"{datatype}","data":[{data}]}}'
        return f'{{"inputs":[{tensor}]}}'.encode()

    flat = body(",".join(["0.5"] * 40_000))  # 160 KB
    assert decoder.inline(flat)
    assert not decoder.inline(body(",".join(["[0]"] * 40_000)))  # nested rows
    assert not decoder.inline(body(",".join(['""'] * 40_000), "BYTES"))  # strings
    assert not decoder.inline(body(",".join(["{}"] * 40_000)))  # objects (35 ms on the loop)
    assert not decoder.inline(body(",".join(["0.5"] * 80_000)))  # past INLINE_MAX_BYTES
    assert decoder.inline(body(",".join(["[0]"] * 900)))  # 4 KB: too small to matter
    # A binary request's tensors are not JSON: only its header is counted.
    header = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [40_000], "datatype": "UINT8",
                     "parameters": {"binary_data_size": 40_000}}]}
    )  # fmt: skip
    binary = header + b"[" * 40_000
    assert decoder.inline(binary, str(len(header)))
    assert not decoder.inline(binary)


def test_json_tokens_counts_brackets_braces_and_quotes_and_nothing_else() -> None:
    """The count that sends a body to the helper: exactly `[`, `{` and `"` among all 256
    byte values (its `[`/`{` comparison is one masked by the 0x20 bit)."""
    every_byte = bytes(range(256))
    assert json_tokens(every_byte) == 3
    assert json_tokens(every_byte * 1000 + b'[{"') == 3003
    assert json_tokens(b"") == 0


def test_parameters_nested_too_deep_to_hand_back_from_the_helper_are_decoded_on_the_loop() -> None:
    """JSON may nest 1,024 levels; pickle, which hands the helper's result back, stops
    sooner. Such a request (a fronts parity test's) was a 500: it decodes on the loop as a
    small body does, and a body too large for that is a 400 that says why."""
    deep = b'{"a":' * 1000 + b"1" + b"}" * 1000
    body = (
        b'{"parameters":{"deep":' + deep + b'},"inputs":[{"name":"x","datatype":"FP32",'
        b'"shape":[1,4],"data":[1,2,3,4]}]}'
    )

    async def decode(inline_max: int) -> DecodedRequest:
        decoder = BodyDecoder(inline_max_bytes=inline_max)
        try:
            return await decoder.decode(body, None)
        finally:
            decoder.close()

    decoded = asyncio.run(decode(len(body)))  # past the token count: the helper's
    assert decoded.inputs["x"].tolist() == [[1.0, 2.0, 3.0, 4.0]]
    with pytest.raises(BadRequest, match="nests too deep"):
        asyncio.run(decode(16))  # a body too large to decode on the loop


def _one_input(shape: list[int], data: str) -> bytes:
    tensor = {"name": "x", "shape": shape, "datatype": "FP32", "data": []}
    return orjson.dumps({"inputs": [tensor]}).replace(b'"data":[]', f'"data":[{data}]'.encode())


def test_a_large_body_of_too_many_json_arrays_is_refused_before_it_is_parsed() -> None:
    """Rows nested one value each (`[[0],[0],...]`) cost the decoder about 30 times their
    bytes in memory and ten times a flat list's time: a 61 KB gzip body inflating to 63 MB
    of them held the helper 31 s and 2.2 GB. The helper counts a body's arrays, objects
    and strings first, and a body over the request's limit is a 413 that says what to send
    instead; one at the limit decodes, and so does more data as one flat list."""
    max_strings = 1_000
    limit = max_strings + JSON_VALUES_SLACK
    empty = _one_input([0, 1], "")  # the body's own: its keys, the tensor, its shape...
    at_limit = limit - (empty.count(b"[") + empty.count(b"{") + empty.count(b'"') // 2)

    def nested(rows: int) -> bytes:
        return _one_input([rows, 1], ",".join(["[0]"] * rows))

    async def decode(body: bytes, remote: bool = False) -> Any:
        decoder = BodyDecoder(inline_max_bytes=16, max_strings=max_strings)
        try:
            if remote:  # a remote model's header is read in the helper too
                return await decoder.pass_through_header(body, None)
            return await decoder.decode(body, None)
        finally:
            decoder.close()

    assert asyncio.run(decode(nested(at_limit))).inputs["x"].shape == (at_limit, 1)
    flat = _one_input([limit * 2], ",".join(["0"] * (limit * 2)))
    assert asyncio.run(decode(flat)).inputs["x"].shape == (limit * 2,)
    assert asyncio.run(decode(nested(at_limit), remote=True)) == {}
    for remote in (False, True):
        with pytest.raises(PayloadTooLarge, match=f"more than {limit} arrays.*one flat list"):
            asyncio.run(decode(nested(at_limit + 1), remote))
