"""The JSON of the lane's usual infer request done in a front process (`[server] fronts`):
its body decoded there and its answer encoded there, the tensors crossing the link as raw
bytes.

With fronts, the engine's loop is the limit: decoding a request's JSON and encoding its
answer were about a seventh of its CPU a tiny request, and most of it for large JSON
tensors. So a front decodes the lane's usual request itself and sends its tensors beside
the body (`pack`); the engine rebuilds the arrays (no copy, `unpack`) and skips its own
decoding. Anything else goes as before, the body alone, and the engine decodes it: a body
that does not decode (so that the engine's answer and its order of checks stay its own: a
stranger's bad body gets 401, not 400), one that names shared memory (the regions are
registered in the engine), BYTES or other object tensors, a compressed body, or one past
the size limit. The front decodes only for a key the engine has served before on the
request's model and version, not refused there since nor told to retry later
(server/front.py), so that a request the engine refuses before decoding it (a stranger's
key, an unknown model, a tenant over its rate) costs no decoding there, as in one
process. orjson reads JSON up to 1,024 levels deep, within the 2,000 that marshal carries.

The answer to a request the front decoded comes back the same way: its outputs as raw
bytes (`pack_outputs`), which the front encodes (`encode_answer`: the same body, headers
and compression as the engine's), unless it holds what only the engine encodes
(classification, BYTES): then the engine sends the finished answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infergate.server.codec import DecodedRequest, decode_request
from infergate.server.compression import MIN_BYTES, compress_response
from infergate.server.encoding import (
    SMALL_OUTPUT_BYTES,
    encode_response,
    large_answer,
    response_headers,
)
from infergate.server.infer_request import HEADER_LENGTH
from infergate.tensors import NUMPY_TO_V2, V2_TO_NUMPY, Array

# (id, [(input, datatype, shape, bytes)], outputs, binary outputs, binary by default,
# parameters, output parameters): plain values, which marshal carries.
Packed = tuple[Any, ...]
# (model, version, [(output, datatype, shape, bytes)]): an answer's outputs, likewise.
PackedOutputs = tuple[str, int, list[tuple[str, str, tuple[int, ...], bytes]]]

_LOCAL_ONLY = b"shared_memory"
# A BYTES tensor goes to the engine as its body: one named so (as JSON writes it, unescaped)
# is not decoded here first only to be decoded again there.
_STRINGS = b'"BYTES"'


def pack(
    body: bytes, headers: dict[bytes, bytes], max_body: int
) -> tuple[DecodedRequest, Packed] | None:
    """The request in `body` decoded, and as the link carries it; None when the engine
    must decode it itself (see the module docstring)."""
    if (
        len(body) > max_body
        or b"content-encoding" in headers
        or _LOCAL_ONLY in body
        or _STRINGS in body
    ):
        return None
    length = headers.get(HEADER_LENGTH)
    try:
        decoded = decode_request(body, None if length is None else length.decode("ascii"))
    except Exception:  # a BadRequest, or a header that is not text: the engine says so
        return None
    tensors = []
    for name, array in decoded.inputs.items():
        datatype = NUMPY_TO_V2.get(array.dtype)  # native numbers only
        if datatype is None:
            return None
        tensors.append((name, datatype, array.shape, array.tobytes()))
    return decoded, (
        decoded.id,
        tensors,
        decoded.outputs,
        decoded.binary_outputs,
        decoded.binary_by_default,
        decoded.parameters,
        decoded.output_parameters,
    )


def unpack(packed: Packed) -> DecodedRequest:
    """The engine's side: the DecodedRequest that `pack` was given."""
    request_id, tensors, outputs, binary, by_default, parameters, output_parameters = packed
    inputs: dict[str, Array] = {
        name: np.frombuffer(data, V2_TO_NUMPY[datatype]).reshape(shape)
        for name, datatype, shape, data in tensors
    }
    return DecodedRequest(
        request_id, inputs, outputs, binary, by_default, parameters, output_parameters
    )


def pack_outputs(
    model: str, version: int, outputs: dict[str, Array], decoded: DecodedRequest
) -> PackedOutputs | None:
    """The engine's side: an answer's outputs as the link carries them; None when the
    engine must encode the answer itself (classification asked for, an output that is
    not plain numbers, or a large answer, which the engine encodes in slices:
    server/large_answers.py)."""
    if decoded.output_parameters:
        return None
    tensors = []
    for name, array in outputs.items():
        datatype = NUMPY_TO_V2.get(array.dtype)
        if datatype is None or (array.nbytes > SMALL_OUTPUT_BYTES and large_answer(outputs, {})):
            return None
        tensors.append((name, datatype, array.shape, array.tobytes()))
    return model, version, tensors


def encode_answer(
    packed: PackedOutputs, decoded: DecodedRequest, request_headers: list[tuple[bytes, bytes]]
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The front's side: the headers and body of the answer to a request it decoded, as
    the engine would have written them (server/infer_route.py)."""
    model, version, tensors = packed
    outputs: dict[str, Array] = {
        name: np.frombuffer(data, V2_TO_NUMPY[datatype]).reshape(shape)
        for name, datatype, shape, data in tensors
    }
    body, json_length = encode_response(model, version, outputs, decoded)
    headers = response_headers(json_length)
    if len(body) >= MIN_BYTES:
        body = compress_response(request_headers, headers, body, 200)
    headers.append((b"content-length", b"%d" % len(body)))
    return headers, body
