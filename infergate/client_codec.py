"""The KServe V2 inference request and response bodies, as the client sends and reads
them: JSON with binary tensors after it (`Inference-Header-Content-Length`), or JSON
alone. numpy and the tensor codec load on first use, not with the client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from infergate.client_errors import json_kind

if TYPE_CHECKING:
    from infergate.tensors import Array

# The largest inference answer the client reads (a larger one is refused unread): the
# gateway's own cap on an upstream's answer ([remote] max_answer_mb).
MAX_ANSWER_MB = 256
# An answer that is not an inference's (the admin API's documents, metadata, statistics):
# far more than any infergate sends, and parsed into Python objects at tens of times its
# size, so well below an inference's MAX_ANSWER_MB. The CLI's, top's and bench's cap.
MAX_DOCUMENT_BYTES = 16 << 20
MAX_ERROR_BODY_BYTES = 1 << 20  # of an error's body: its start says what went wrong


@dataclass(frozen=True)
class InferResponse:
    model: str
    version: str
    id: str | None
    outputs: dict[str, Array]
    raw: dict[str, Any]


def encode_infer_request(
    inputs: dict[str, Array],
    outputs: list[str] | None = None,
    binary: bool = True,
    request_id: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A V2 request body and its headers, binary tensors after the JSON header."""
    # (numpy, 60 ms and more, only for the commands that send or read tensors)
    from infergate.tensors import to_wire, v2_datatype

    tensors = []
    blobs = []
    for name, array in inputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": v2_datatype(array.dtype),
            "shape": list(array.shape),
        }
        if binary:
            blob = to_wire(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            flat = array.reshape(-1)
            entry["data"] = (
                [x.decode() if isinstance(x, bytes) else x for x in flat]
                if array.dtype.kind == "O"
                else flat.tolist()
            )
        tensors.append(entry)
    doc: dict[str, Any] = {"inputs": tensors, "parameters": dict(parameters or {})}
    if binary:
        doc["parameters"]["binary_data_output"] = True
    if outputs:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    if request_id is not None:
        doc["id"] = request_id
    header = orjson.dumps(doc)
    if not blobs:
        return header, {"Content-Type": "application/json"}
    return b"".join([header, *blobs]), {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


def decode_infer_response(body: bytes, header_length: str | None) -> InferResponse:
    """A V2 inference response (JSON, binary tensors after it); ValueError saying what is
    wrong with one that is not."""
    try:
        return _decode_infer_response(body, header_length)
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def _decode_infer_response(body: bytes, header_length: str | None) -> InferResponse:
    import numpy as np

    from infergate.tensors import from_wire, numpy_dtype

    if header_length is None:
        json_len = len(body)
    else:
        json_len = int(header_length) if header_length.strip().isdigit() else -1
        if not 0 <= json_len <= len(body):
            raise ValueError(
                f"Inference-Header-Content-Length {header_length!r} does not fit a body of "
                f"{len(body)} bytes"
            )
    doc = orjson.loads(body[:json_len])
    if not isinstance(doc, dict):
        raise ValueError(f"the JSON is {json_kind(doc)}, not an object")
    offset = json_len
    outputs: dict[str, Array] = {}
    for out in doc.get("outputs") or []:
        name, datatype, shape = out["name"], out["datatype"], tuple(out["shape"])
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise ValueError(f"an output's name and datatype are not strings: {out}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"output {name!r} has the shape {list(shape)}")
        if name in outputs:
            raise ValueError(f"output {name!r} comes twice")
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(body):
                raise ValueError(f"output {name!r}: binary_data_size {size} runs past the body")
            outputs[name] = from_wire(body[offset : offset + size], datatype, shape)
            offset += size
        elif datatype == "BYTES":
            flat = np.array(
                [s.encode() if isinstance(s, str) else s for s in out["data"]], dtype=object
            )
            outputs[name] = flat.reshape(shape)
        else:
            dtype = numpy_dtype(datatype)
            outputs[name] = np.array(out["data"], dtype=dtype).reshape(shape)
    return InferResponse(
        _text(doc.get("model_name")),
        _text(doc.get("model_version")),
        doc.get("id"),
        outputs,
        doc,
    )


def _text(value: Any) -> str:
    return "" if value is None else str(value)
