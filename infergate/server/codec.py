"""KServe V2 infer requests → numpy, with orjson and numpy directly (no pydantic for
tensors: serving overhead is a feature): JSON tensors, the binary tensor data extension
and shared-memory inputs, as tritonclient.http sends them, each bounded before it is built.
Answers are written by server/encoding.py."""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import numpy as np
import orjson

from infergate.engine.triton.shared_memory import SYSTEM_SHM, wants_shared_memory
from infergate.errors import BadRequest, PayloadTooLarge, shown
from infergate.tensors import V2_TO_NUMPY, Array, from_wire, numpy_dtype

Body = bytes | bytearray | memoryview  # a request body, as read or as mapped


class DeferredBytes(NamedTuple):
    """A binary BYTES input left in its wire form, for a caller that parses it in steps."""

    data: memoryview
    shape: tuple[int, ...]


class DecodedRequest(NamedTuple):
    id: str | None
    inputs: dict[str, Array]
    outputs: tuple[str, ...] | None
    binary_outputs: frozenset[str]
    binary_by_default: bool
    parameters: dict[str, Any]
    # per-output parameters beyond binary_data (shared memory, classification), by name
    output_parameters: dict[str, dict[str, Any]] = {}  # never mutated: one shared default is fine
    # With decode_request(defer_bytes=True): binary BYTES inputs still to parse (their
    # place in `inputs` holds an empty array until then).
    deferred: dict[str, DeferredBytes] | None = None


def json_object(raw: Body, expected: str = "a JSON object") -> dict[str, Any]:
    """A request body that must be a JSON object; 400 naming what was expected."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"request body must be {expected}")
    return doc


_AN_INFER_REQUEST = "a JSON object with an 'inputs' array"


# No tensor numpy can hold has more elements than this (its size in bytes, at 8 bytes an
# element, must fit an int64); a shape whose product passes it would overflow before any
# size check could refuse it.
_MAX_ELEMENTS = 2**59
_MAX_DIMS = 64  # numpy's most

# A BYTES element is a Python bytes object in the gateway (and again in the worker): about
# 50 bytes of header and pointer whatever its length, so a body of one-byte strings takes
# ten times its size in memory, a JSON one more (a 14 MB body held 260 MB in the gateway).
# A request may hold one BYTES element per this many bytes of the body limit, which keeps
# what its strings take in memory within about the body limit (64 MB: 1,048,576 elements).
BYTES_ELEMENT_COST = 64


def strings_limit(max_request_bytes: int) -> int:
    """The most BYTES elements a request may hold under a body limit of this size."""
    return max(1, max_request_bytes // BYTES_ELEMENT_COST)


DEFAULT_MAX_STRINGS = strings_limit(64 << 20)  # the default max_request_mb's

# No model takes more tensors, nor names one longer (ONNX exports' longest run to about
# 200 characters). Each input costs the gateway its own objects and mapping whatever its
# size (a 30 MB body of 530,000 one-value inputs took 2.7 GB), and names come back in
# errors: both are bounded before anything is built for them.
MAX_TENSORS = 1024
MAX_NAME = 1024


def _shape(name: str, value: Any) -> tuple[int, ...]:
    if type(value) is list:  # a loop, not all(<genexpr>): this runs for every input
        if len(value) > _MAX_DIMS:
            raise BadRequest(
                f"input {name!r}: shape has {len(value)} dimensions; a tensor has at most "
                f"{_MAX_DIMS}"
            )
        # The dimensions but zeros multiplied: numpy refuses a shape whose product passes
        # its limit even when a zero makes the tensor empty.
        held = 1
        for d in value:
            if type(d) is not int or d < 0:  # type(), not isinstance: True is not a size
                break
            held *= d or 1
        else:
            if held > _MAX_ELEMENTS:
                raise BadRequest(
                    f"input {name!r}: shape {shown(value)} has more elements than any tensor "
                    "can hold. Hint: check the shape; its product is the element count"
                )
            return tuple(value)
    raise BadRequest(
        f"input {name!r}: 'shape' must be a list of non-negative integers, got {shown(value)}"
    )


# struct's format letter for each float datatype; "=" packs in native order with standard
# sizes, which (unlike native "@") refuse a number out of the type's range. By the V2 name:
# a str's hash is kept, a numpy dtype's is computed each time.
_PACK = {"FP16": "e", "FP32": "f", "FP64": "d"}

# Each float dtype narrower than the float64 JSON numbers parse to: its largest value (for
# the message) and the least magnitude that rounds to infinity in it, from which a number
# is refused; one that rounds to the largest value is in range (struct's packing, the
# fast path above, draws the same line).
_FLOAT_LIMITS = {
    np.dtype(np.float16): (65504.0, 65520.0),
    np.dtype(np.float32): (float(np.finfo(np.float32).max), 2.0**128 * (1 - 2.0**-25)),
}


_PACKERS: dict[tuple[int, str], struct.Struct] = {}
_MAX_PACKERS = 256  # element counts remembered (each a few hundred bytes)


def _packer(count: int, letter: str) -> struct.Struct:
    """struct's packer for `count` values of `letter`, kept: struct's own cache of formats
    costs a format string built and looked up each time."""
    packer = _PACKERS.get((count, letter))
    if packer is None:
        if len(_PACKERS) >= _MAX_PACKERS:  # counts are the clients' to choose
            _PACKERS.clear()
        packer = _PACKERS[(count, letter)] = struct.Struct(f"={count}{letter}")
    return packer


def _json_tensor(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> Array:
    count = math.prod(shape)
    if datatype == "BYTES":
        flat = np.asarray(data, dtype=object).reshape(-1) if data != [] else np.empty(0, object)
        if flat.size != count:
            raise BadRequest(
                f"input {name!r} has {flat.size} elements of data but shape "
                f"{list(shape)} needs {count}"
            )
        out = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if not isinstance(item, (str, bytes)):
                raise BadRequest(
                    f"input {name!r} is BYTES but element {i} is {shown(item)}, not a string"
                )
            out[i] = item.encode("utf-8") if isinstance(item, str) else item
        return out.reshape(shape)
    dtype = V2_TO_NUMPY[datatype]  # (decode_request checked it)
    pack = _PACK.get(datatype)
    if (
        pack is not None
        and type(data) is list
        and 0 < count == len(data)
        and type(data[0]) is float
    ):
        # The usual request: a flat list of JSON numbers into a float tensor. struct packs
        # them straight to the tensor's type, and refuses (falling through to the general
        # path, which says what is wrong) anything not a number, and any number out of
        # the type's range: 1.3 µs for 64 FP32 values, against 5.7 µs for np.array's
        # dtype and shape discovery, its range check and the cast.
        try:
            packer = _PACKERS.get((count, pack)) or _packer(count, pack)  # (usually kept)
            packed = packer.pack(*data)
        except (struct.error, OverflowError, TypeError):
            pass
        else:
            return np.ndarray(shape, dtype, packed)  # (one call: frombuffer and reshape)
    try:
        raw = np.array(data)
    except ValueError:
        raise BadRequest(
            f"input {name!r}: 'data' is a ragged nested list; give a flat list "
            f"or one nested to shape {list(shape)}"
        ) from None
    if raw.size != count:
        raise BadRequest(
            f"input {name!r} has {raw.size} elements of data but shape {list(shape)} needs {count}"
        )
    if raw.dtype.kind == "f" and dtype.kind == "f" and count:
        # The usual request (JSON numbers into a float tensor): one range check, not the
        # general path's eight (this runs for every input of every JSON request).
        _check_float_range(name, datatype, raw)
        return raw.astype(dtype, copy=False).reshape(shape)
    if raw.size and dtype.kind in "iu" and raw.dtype.kind in "fO":
        # Integers numpy would not keep as integers (one from 2**63 makes floats of all,
        # one from 2**64 objects): an UINT64's upper half is valid, and a value too
        # large for any is out of range, not fractional. Anything else falls through.
        whole = _whole_numbers(name, datatype, dtype, data)
        if whole is not None:
            return whole.reshape(shape)
    if raw.size and raw.dtype.kind not in "biuf":
        raise BadRequest(
            f"input {name!r} is {datatype} but its data holds non-numeric values "
            f"(such as {shown(raw.reshape(-1)[0])})"
        )
    if raw.size and dtype.kind != "b" and raw.dtype.kind == "b":
        raise BadRequest(f"input {name!r} is {datatype} but its data holds true/false values")
    if raw.size and dtype.kind in "iu":
        info = np.iinfo(dtype)  # type: ignore[type-var]  # dtype.kind is "i" or "u" here
        if raw.dtype.kind == "f":
            # An integer past 64 bits comes from JSON as a float: out of range, not
            # fractional (compared as Python numbers: exact, where numpy's are not).
            values = raw.reshape(-1).tolist()
            if all(math.isfinite(v) and v == int(v) for v in values) and (
                min(values) < info.min or max(values) > info.max
            ):
                raise BadRequest(
                    f"input {name!r}: values out of range for {datatype} ({info.min}..{info.max})"
                )
            raise BadRequest(
                f"input {name!r} is {datatype} but its data holds fractional "
                "numbers; send integers or change the datatype"
            )
        if raw.min() < info.min or raw.max() > info.max:
            raise BadRequest(
                f"input {name!r}: values out of range for {datatype} ({info.min}..{info.max})"
            )
    if raw.size and dtype.kind == "b" and raw.dtype.kind != "b":
        raise BadRequest(f"input {name!r} is BOOL; send true/false values")
    if raw.size:  # integers into a narrow float type
        _check_float_range(name, datatype, raw)
    return raw.astype(dtype, copy=False).reshape(shape)


def _whole_numbers(name: str, datatype: str, dtype: np.dtype[Any], data: Any) -> Array | None:
    """`data` as integers of `dtype` when every item is a JSON integer (400 when one is out
    of the type's range), else None: the general checks say what is wrong."""
    items = np.array(data, dtype=object).reshape(-1)
    if not all(type(x) is int for x in items):
        return None
    info = np.iinfo(dtype)
    if min(items) < info.min or max(items) > info.max:
        raise BadRequest(
            f"input {name!r}: values out of range for {datatype} ({info.min}..{info.max})"
        )
    return np.array(items.tolist(), dtype=dtype)


def _check_float_range(name: str, datatype: str, raw: Array) -> None:
    """400 when a number of `raw` (not empty) would round to infinity in `datatype`, one
    of _FLOAT_LIMITS' narrow float types; other types take any number. NaN passes (it
    compares false), and max/min, not abs(): abs of int64's least value is negative."""
    limits = _FLOAT_LIMITS.get(numpy_dtype(datatype))
    if limits is not None and (raw.max() >= limits[1] or raw.min() <= -limits[1]):
        raise BadRequest(f"input {name!r}: values out of range for {datatype} (±{limits[0]:g})")


_PENDING = np.empty(0, dtype=object)
_NO_BINARY = memoryview(b"")  # a JSON-only request's binary part (read-only: shared)


def decode_request(
    body: Body,
    header_length: str | None,
    defer_bytes: bool = False,
    max_strings: int = DEFAULT_MAX_STRINGS,
) -> DecodedRequest:
    """Parse an infer request; errors name the input and say expected vs got.
    `defer_bytes` leaves binary BYTES inputs in `deferred`, unparsed; `max_strings`: the
    most BYTES elements the request may hold (its shapes are checked before any is built)."""
    if header_length is not None:
        json_len = _header_length(header_length, len(body))
        doc = json_object(body[:json_len], _AN_INFER_REQUEST)
        binary = memoryview(body)[json_len:]
    else:
        doc, binary = json_object(body, _AN_INFER_REQUEST), _NO_BINARY
    raw_inputs = doc.get("inputs")
    if type(raw_inputs) is not list or not raw_inputs:
        raise BadRequest(
            "request must have a non-empty 'inputs' array of tensors "
            "(each with name, datatype, shape and data)"
        )
    if len(raw_inputs) > MAX_TENSORS:
        raise _too_many("inputs", len(raw_inputs))
    inputs: dict[str, Array] = {}
    deferred: dict[str, DeferredBytes] = {}
    offset = 0
    strings = 0
    shm_read = 0  # bytes read from shared-memory regions (bounded as a body is)
    for i, item in enumerate(raw_inputs):
        name = item.get("name") if type(item) is dict else None
        if type(name) is not str:
            raise BadRequest(f"inputs[{i}] must be an object with a string 'name'")
        if len(name) > MAX_NAME:
            raise _too_long(f"inputs[{i}]", name)
        if name in inputs:
            raise BadRequest(f"input {name!r} appears twice")
        datatype = item.get("datatype")
        if type(datatype) is not str or datatype not in V2_TO_NUMPY:
            raise BadRequest(
                f"input {name!r} has datatype {shown(datatype)}; expected one of "
                f"{', '.join(V2_TO_NUMPY)}"
            )
        shape = _shape(name, item.get("shape"))
        if datatype == "BYTES":
            strings += math.prod(shape)
            if strings > max_strings:
                raise too_many_strings(name, strings, max_strings)
        params = item.get("parameters")
        size = params.get("binary_data_size") if type(params) is dict else None
        if size is not None:
            if type(size) is not int or size < 0 or offset + size > len(binary):
                raise BadRequest(
                    f"input {name!r} says binary_data_size {shown(size)} but only "
                    f"{len(binary) - offset} bytes of binary data remain"
                )
            try:
                if defer_bytes and datatype == "BYTES":
                    deferred[name] = DeferredBytes(binary[offset : offset + size], shape)
                    inputs[name] = _PENDING
                else:
                    inputs[name] = from_wire(binary[offset : offset + size], datatype, shape)
            except ValueError as exc:
                raise BadRequest(f"input {name!r} {exc}") from None
            offset += size
        elif "data" in item:
            inputs[name] = _json_tensor(name, datatype, shape, item["data"])
        elif wants_shared_memory(params):
            inputs[name], size = SYSTEM_SHM.read_input(name, datatype, shape, params, shm_read)
            shm_read += size
        else:
            raise BadRequest(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
    if offset != len(binary):
        raise BadRequest(
            f"{len(binary) - offset} bytes of binary data follow the JSON header "
            "but no input claims them"
        )
    decoded = _decode_outputs(doc, inputs)
    return decoded._replace(deferred=deferred) if deferred else decoded


def _too_many(what: str, count: int) -> BadRequest:
    return BadRequest(f"request has {count} {what}; a request has at most {MAX_TENSORS}")


def _too_long(where: str, name: str) -> BadRequest:
    return BadRequest(
        f"{where}.name is {len(name)} characters long ({shown(name)}); a tensor name has at "
        f"most {MAX_NAME}"
    )


# Arrays, objects and strings a large body's JSON may hold beyond its BYTES limit: the
# keys, names and parameters around its tensors.
JSON_VALUES_SLACK = 65_536
_JSON_OPENERS = (ord("["), ord("{"))
_COUNT_SLICE = 1 << 22  # bytes compared at a time (a 4 MB temporary, not one per body)


def check_json_values(json_part: Body, max_strings: int) -> None:
    """413 before parsing when `json_part` holds more arrays, objects and strings than a
    request may: `max_strings` (one per BYTES_ELEMENT_COST bytes of the body limit) and
    JSON_VALUES_SLACK. Each becomes a Python object as it is parsed, and rows nested one
    value each (`[[0],[0],...]`) cost about 30 times their bytes in memory and ten times a
    flat list's time: a 61 KB gzip body of them inflates to 63 MB, which held the decoder
    31 s and 2.2 GB. Counted with numpy (0.1 s for 64 MB, bytes.count three times that);
    for the decoder's large bodies only: the loop's are small enough not to need it."""
    limit = max_strings + JSON_VALUES_SLACK
    data = np.frombuffer(json_part, np.uint8)
    found = 0
    for start in range(0, len(data), _COUNT_SLICE):
        chunk = data[start : start + _COUNT_SLICE]
        found += int(np.count_nonzero(chunk == _JSON_OPENERS[0]))
        found += int(np.count_nonzero(chunk == _JSON_OPENERS[1]))
        found += int(np.count_nonzero(chunk == ord('"'))) // 2
        if found > limit:
            raise PayloadTooLarge(
                f"the request's JSON holds more than {limit} arrays, objects and strings, "
                f"the most a request may (one per {BYTES_ELEMENT_COST} bytes of the body "
                "limit, and the keys around its tensors: each is a Python object in the "
                "gateway). Hint: send each tensor's data as one flat list, or as binary "
                "data (the Inference-Header-Content-Length header), or raise "
                "max_request_mb in the profile's [server] table"
            )


def too_many_strings(name: str, count: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"input {name!r} brings the request to {count} BYTES elements; a request may hold at "
        f"most {limit} (one per {BYTES_ELEMENT_COST} bytes of the body limit: each element "
        "is a Python object in the gateway and the worker). Hint: send fewer strings per "
        "request, or raise max_request_mb in the profile's [server] table"
    )


# Shared-memory regions are this machine's: an upstream server cannot read them.
_LOCAL_ONLY = b"shared_memory_region"


def pass_through_header(body: Body, header_length: str | None) -> dict[str, Any] | None:
    """The JSON header of a request bound for a remote model, without its `inputs` (the
    body goes upstream unchanged; only its other fields are read here), or None when it
    names this machine's shared memory and must be decoded here instead."""
    json_len = len(body) if header_length is None else _header_length(header_length, len(body))
    header = body[:json_len]
    if isinstance(header, memoryview):  # (a large body: `in` would look for an int)
        header = header.tobytes()
    if _LOCAL_ONLY in header:
        return None
    doc = json_object(header, _AN_INFER_REQUEST)
    doc.pop("inputs", None)  # (from a large body: tens of MB of Python objects, not sent back)
    return doc


def _header_length(header_length: str, body_length: int) -> int:
    # ASCII digits only, as Content-Length: int() also takes "+5", " 5", "5_0" and "٥",
    # which the body decoder, reading digits, took for no length and decoded on the loop.
    if not (header_length.isascii() and header_length.isdigit()):
        raise BadRequest(
            "Inference-Header-Content-Length must be the JSON header's length in bytes, "
            f"in digits, got {shown(header_length)}"
        )
    if len(header_length) > 18:  # (int() of thousands of digits is itself a cost)
        raise BadRequest(
            f"Inference-Header-Content-Length has {len(header_length)} digits; a length "
            "in bytes has at most 18"
        )
    json_len = int(header_length)
    if not 0 <= json_len <= body_length:
        raise BadRequest(
            f"Inference-Header-Content-Length is {json_len} but the body "
            f"has only {body_length} bytes"
        )
    return json_len


_NO_NAMES: frozenset[str] = frozenset()


def _flag(params: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = params.get(key, default)
    if type(value) is not bool:
        raise BadRequest(f"{where}.{key} must be true or false, got {shown(value)}")
    return value


def _decode_outputs(doc: dict[str, Any], inputs: dict[str, Array]) -> DecodedRequest:
    params = doc.get("parameters")
    if params is None:
        params = {}
    if type(params) is not dict:
        raise BadRequest(f"'parameters' must be an object, got {shown(params)}")
    binary_default = (  # (most requests: no parameters to read)
        _flag(params, "binary_data_output", "parameters", False) if params else False
    )
    request_id = doc.get("id")
    if request_id is not None and type(request_id) is not str:
        if type(request_id) not in (int, float):  # (a number: written back as text)
            raise BadRequest(f"'id' must be a string, got {shown(request_id)}")
        request_id = str(request_id)
    raw_outputs = doc.get("outputs")
    if raw_outputs is None or raw_outputs == []:  # every output, in the default encoding
        # (`"outputs": []` means every output too, as in Triton)
        return DecodedRequest(request_id, inputs, None, _NO_NAMES, binary_default, params)
    if type(raw_outputs) is not list:
        raise BadRequest("'outputs' must be an array of {\"name\": ...} objects")
    if len(raw_outputs) > MAX_TENSORS:
        raise _too_many("outputs", len(raw_outputs))
    names = []
    binary: set[str] = set()
    extra: dict[str, dict[str, Any]] = {}
    for i, out in enumerate(raw_outputs):
        if type(out) is not dict or type(out.get("name")) is not str:
            raise BadRequest(f"outputs[{i}] must be an object with a string 'name'")
        if len(out["name"]) > MAX_NAME:
            raise _too_long(f"outputs[{i}]", out["name"])
        names.append(out["name"])
        out_params = out.get("parameters")
        if out_params is None:
            out_params = {}
        if type(out_params) is not dict:
            raise BadRequest(f"outputs[{i}].parameters must be an object, got {shown(out_params)}")
        if _flag(out_params, "binary_data", f"outputs[{i}].parameters", binary_default):
            binary.add(out["name"])
        if len(out_params) > ("binary_data" in out_params):
            extra[out["name"]] = out_params
    return DecodedRequest(request_id, inputs, tuple(names), frozenset(binary), False, params, extra)
