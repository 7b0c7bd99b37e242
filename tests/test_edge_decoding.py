"""Large bodies decode off the event loop (server/decoding.py) to the same tensors as small
ones decode inline, whichever way they go: the helper process for JSON, slices on the loop
for binary BYTES."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from infergate.client import encode_infer_request
from infergate.errors import BadRequest
from infergate.server.codec import DecodedRequest, decode_request
from infergate.server.decoding import BodyDecoder
from infergate.tensors import Array

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


def test_a_large_body_with_bad_bytes_is_a_400_either_way() -> None:
    body, headers = encode_infer_request({"s": TENSORS["s"]}, binary=True)
    length = headers["Inference-Header-Content-Length"]
    cut = body[:-1]
    with pytest.raises(BadRequest):
        decode_request(cut, length)
    with pytest.raises(BadRequest, match="input 's'"):
        _decode_both(cut, length)
