"""An infer request decoded in a front process (`[server] fronts`), as the link carries it.

With fronts, the engine's loop is the limit: decoding a request's JSON there was about a
tenth of its CPU a tiny request, and most of it for a large JSON body. So a front decodes
the lane's usual request itself and sends its tensors as raw bytes beside the body; the
engine rebuilds the arrays (no copy) and skips its own decoding. Anything else goes as
before, the body alone, and the engine decodes it: a body that does not decode (so that
the engine's answer and its order of checks stay its own: a stranger's bad body gets
401, not 400), one that names shared memory (the regions are registered in the engine),
BYTES or other object tensors, a compressed body, or one past the size limit. The front
decodes only for a key the engine has accepted before (server/front.py), so that a
stranger's request costs no decoding there, as in one process. orjson reads JSON up to
1,024 levels deep, within the 2,000 that marshal carries.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from infergate.server.codec import DecodedRequest, decode_request
from infergate.server.infer_request import HEADER_LENGTH
from infergate.tensors import V2_TO_NUMPY, Array

# (id, [(input, datatype, shape, bytes)], outputs, binary outputs, binary by default,
# parameters, output parameters): plain values, which marshal carries.
Packed = tuple[Any, ...]

_DATATYPES: Final[dict[np.dtype[np.generic], str]] = {
    dtype: name for name, dtype in V2_TO_NUMPY.items() if name != "BYTES"
}
_LOCAL_ONLY = b"shared_memory"


def pack(body: bytes, headers: dict[bytes, bytes], max_body: int) -> Packed | None:
    """The request in `body` decoded, as the link carries it; None when the engine must
    decode it itself (see the module docstring)."""
    if len(body) > max_body or b"content-encoding" in headers or _LOCAL_ONLY in body:
        return None
    length = headers.get(HEADER_LENGTH)
    try:
        decoded = decode_request(body, None if length is None else length.decode("ascii"))
    except Exception:  # a BadRequest, or a header that is not text: the engine says so
        return None
    tensors = []
    for name, array in decoded.inputs.items():
        datatype = _DATATYPES.get(array.dtype)  # native numbers only
        if datatype is None:
            return None
        tensors.append((name, datatype, array.shape, array.tobytes()))
    return (
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
