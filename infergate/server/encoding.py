"""Infer answers as KServe V2 bodies: JSON, with binary outputs after it where asked for
(`Inference-Header-Content-Length`), outputs written to shared memory where a request
named a region. Requests are read by server/codec.py; an answer too large to encode in one
go on the event loop is LargeAnswer, encoded in slices by server/large_answers.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from infergate.engine.triton.shared_memory import SYSTEM_SHM, wants_shared_memory
from infergate.errors import BadRequest, LargeAnswer
from infergate.server.codec import DecodedRequest
from infergate.tensors import Array, to_wire, v2_datatype


def _json_text(name: str, index: int, item: object) -> str:
    if not isinstance(item, bytes):
        return str(item)
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError:
        # A JSON string is text: replacing the bytes would hand back data the model never
        # produced. Binary data carries any bytes (as Triton's clients ask by default).
        raise BadRequest(
            f"output {name!r} element {index} holds bytes that are not UTF-8 text, which a "
            "JSON string cannot carry. Hint: ask for the output as binary data "
            '(parameters {"binary_data": true} on it, or "binary_data_output": true)'
        ) from None


def _json_data(name: str, array: Array, start: int = 0) -> list[Any] | Array:
    """An output's `data`: numbers as the array itself, which orjson writes straight from
    its memory (half the CPU of `tolist()` and Python floats for 1,000 FP32 values), each
    float in the shortest text that reads back as the same value of its type (an FP32 0.1
    is `0.1`, not the double `0.10000000149011612`; an FP16 is written as that FP32).
    `start`: where `array` begins in its output, when it is a slice of it (for errors)."""
    kind = array.dtype.kind
    if kind in "biuf":  # numbers (the usual output) first: one test of the kind
        if array.flags.c_contiguous and array.dtype.isnative:  # the usual output: a view
            return array.ravel()
        # orjson takes native byte order and C order only: any other array as a native copy
        return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("=")).reshape(-1)
    if kind in ("O", "S", "U"):
        return [_json_text(name, i, x) for i, x in enumerate(array.reshape(-1), start)]
    return array.reshape(-1).tolist()


_JSON = (b"content-type", b"application/json")
_BINARY = (b"content-type", b"application/octet-stream")


def response_headers(json_length: int | None) -> list[tuple[bytes, bytes]]:
    """An answer's content headers, from `encode_response`'s JSON header length."""
    if json_length is None:
        return [_JSON]
    return [_BINARY, (b"inference-header-content-length", b"%d" % json_length)]


# An answer encodes in one go while its tensors hold up to this many bytes (16,384 FP32
# numbers: half a millisecond of orjson on a small machine, about 170 KB of JSON); a
# larger one is encoded in slices, the event loop serving others in between
# (server/large_answers.py: 60 MB of FP32 held the loop 0.9 s as JSON). Outputs of up to
# SMALL_OUTPUT_BYTES bytes are not added up: one comparison an output for the usual answer.
AT_ONCE_BYTES = 64 << 10
SMALL_OUTPUT_BYTES = 4 << 10


def large_answer(outputs: dict[str, Array], extra: dict[str, dict[str, Any]]) -> bool:
    """Whether the outputs an answer's body carries (not those written to shared memory:
    `extra`, DecodedRequest.output_parameters) hold more than AT_ONCE_BYTES."""
    return (
        sum(
            _answer_bytes(array)
            for name, array in outputs.items()
            if not (extra and wants_shared_memory(extra.get(name)))
        )
        > AT_ONCE_BYTES
    )


def _answer_bytes(array: Array) -> int:
    """What an output holds: a BYTES tensor's strings, not numpy's 8 bytes a pointer
    (two strings of 28 MB counted 16 bytes, and were encoded in one go)."""
    if not array.dtype.hasobject:
        return int(array.nbytes)
    try:
        return sum(map(len, array.reshape(-1).tolist()))
    except TypeError:  # (an element without a length: not text)
        return int(array.nbytes)


def encode_response(
    model: str,
    version: int,
    outputs: dict[str, Array],
    request: DecodedRequest,
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header length when binary outputs follow it.
    LargeAnswer when the outputs hold more than AT_ONCE_BYTES."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    extra = request.output_parameters  # shared memory, classification (rare)
    for name, array in outputs.items():
        if (array.nbytes > SMALL_OUTPUT_BYTES or array.dtype.hasobject) and large_answer(
            outputs, extra
        ):
            raise LargeAnswer(model, version, outputs, request)
        entry: dict[str, Any] = {
            "name": name,
            "datatype": v2_datatype(array.dtype),
            "shape": list(array.shape),
        }
        if extra and wants_shared_memory(shm := extra.get(name)):
            SYSTEM_SHM.write_output(name, array, shm)  # no parameters: nothing follows
        elif request.binary_by_default or name in request.binary_outputs:
            blob = to_wire(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_data(name, array)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
