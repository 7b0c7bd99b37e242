"""V2 bodies to numpy and back, without a server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from infergate.client import decode_infer_response, encode_infer_request
from infergate.errors import BadRequest
from infergate.server.codec import decode_request
from infergate.server.encoding import encode_response
from infergate.tensors import (
    V2_TO_NUMPY,
    deserialize_bytes,
    from_wire,
    serialize_bytes,
    to_wire,
)

SAMPLES = {
    name: (
        np.array([[b"a", b"\xff\x00"], [b"", b"long" * 10]], dtype=object)
        if name == "BYTES"
        else np.arange(4).reshape(2, 2).astype(dtype)
    )
    for name, dtype in V2_TO_NUMPY.items()
}


@pytest.mark.parametrize("datatype", list(SAMPLES))
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_round_trip_every_datatype(datatype: str, binary: bool) -> None:
    array = SAMPLES[datatype]
    if datatype == "BYTES" and not binary:
        array = np.array([[b"a", b"b"], [b"", b"\xc3\xa9"]], dtype=object)  # JSON: UTF-8 only
    body, headers = encode_infer_request({"t": array}, binary=binary, request_id="r")
    decoded = decode_request(body, headers.get("Inference-Header-Content-Length"))
    got = decoded.inputs["t"]
    assert got.shape == array.shape
    assert decoded.id == "r"
    response, json_len = encode_response("m", 1, {"t": got}, decoded)
    back = decode_infer_response(response, str(json_len) if json_len else None)
    assert back.outputs["t"].shape == array.shape
    assert list(back.outputs["t"].reshape(-1)) == list(array.reshape(-1))
    if datatype != "BYTES":
        assert back.outputs["t"].dtype == array.dtype


def test_bytes_wire_format() -> None:
    array = np.array([b"ab", b"", b"xyz"], dtype=object)
    raw = serialize_bytes(array)
    assert raw == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x03\x00\x00\x00xyz"
    assert list(deserialize_bytes(raw)) == [b"ab", b"", b"xyz"]
    with pytest.raises(ValueError, match="claims 3 bytes but only 2 remain"):
        deserialize_bytes(raw[:-1])
    with pytest.raises(ValueError, match="needs 4"):
        from_wire(raw, "BYTES", (4,))


def test_bytes_past_what_the_shape_needs_are_refused_without_reading_them() -> None:
    """A small body of zero-length elements holds hundreds of thousands: they were all
    built (0.1 s of the event loop for 1 MB) before their count met the shape's."""
    many = b"\x00\x00\x00\x00" * 250_000
    with pytest.raises(ValueError, match=r"left over after the 2 BYTES elements shape \[1, 2\]"):
        from_wire(many, "BYTES", (1, 2))
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "s",
                    "shape": [1, 2],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(many)},
                }
            ]
        }
    )
    with pytest.raises(BadRequest, match="bytes left over after the 2 BYTES elements"):
        decode_request(header + many, str(len(header)))


def test_outputs_binary_per_output_and_by_default() -> None:
    body = (
        b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[1,2]}],'
        b'"outputs":[{"name":"a","parameters":{"binary_data":true}},{"name":"b"}]}'
    )
    decoded = decode_request(body, None)
    assert decoded.outputs == ("a", "b")
    assert decoded.binary_outputs == frozenset({"a"})
    everything = decode_request(
        b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[1,2]}],'
        b'"parameters":{"binary_data_output":true}}',
        None,
    )
    assert everything.outputs is None
    assert everything.binary_by_default


@pytest.mark.parametrize(
    ("data", "datatype", "message"),
    [
        ([300, 1], "UINT8", "out of range for UINT8"),
        ([1, 0], "BOOL", "BOOL; send true/false"),
        ([[1, 2], [3]], "FP32", "ragged"),
        ([1e39, 1.5], "FP32", "out of range for FP32"),  # the float fast path's one check
        ([1.5, -1e39], "FP32", "out of range for FP32"),
        ([70000.0, 1.5], "FP16", "out of range for FP16"),
        ([1.5, "x"], "FP32", "non-numeric values"),  # past the float path: a string
        ([1.5, [2.0]], "FP32", "ragged"),
        ([1.5, {}], "FP64", "non-numeric values"),
        ([1, "x"], "BYTES", "element 0 is 1, not a string"),
        # Integers numpy holds as floats (from 2**63) or objects (from 2**64), or that JSON
        # reads as floats (from 2**64): out of range, not "fractional"
        ([-1, 2**64 - 1], "INT64", "out of range for INT64"),
        ([-1, 2**64 - 1], "UINT64", "out of range for UINT64"),
        ([2**64, 0], "UINT64", "out of range for UINT64"),
        ([2**63, 1.5], "UINT64", "fractional"),
        ([2**64 - 1, "x"], "UINT64", "non-numeric values"),
    ],
)
def test_json_data_checks(data: list[object], datatype: str, message: str) -> None:
    body = b'{"inputs":[{"name":"x","datatype":"%s","shape":[2],"data":%s}]}' % (
        datatype.encode(),
        str(data).replace("'", '"').encode(),
    )
    with pytest.raises(BadRequest, match=message):
        decode_request(body, None)


@pytest.mark.parametrize("data", [[2**64 - 1, 0], [2**63, 1], [[2**63], [2**64 - 1]]])
def test_uint64_takes_its_upper_half_from_json(data: list[object]) -> None:
    """numpy makes floats of integers from 2**63 mixed with smaller ones: they were
    refused as "fractional" though UINT64 holds them."""
    shape = [2] if type(data[0]) is int else [2, 1]
    body = b'{"inputs":[{"name":"x","datatype":"UINT64","shape":%s,"data":%s}]}' % (
        orjson.dumps(shape),
        str(data).encode(),
    )
    got = decode_request(body, None).inputs["x"]
    assert got.dtype == np.uint64
    assert got.tolist() == data


_BIGGEST_PRINTED = {"FP16": 65504.0, "FP32": 3.4028235e38, "FP64": 1.7976931348623157e308}


@pytest.mark.parametrize("datatype", list(_BIGGEST_PRINTED))
def test_json_numbers_become_the_float_type_exactly(datatype: str) -> None:
    """Floats, ints and true/false mixed, rounded to the tensor's type as numpy rounds
    them; the largest finite value, as it prints, is in range."""
    dtype = V2_TO_NUMPY[datatype]
    data = [0.1, 2, True, -1e-7, 1 / 3, 123456.789 if datatype != "FP16" else 1234.5]
    data.append(_BIGGEST_PRINTED[datatype])  # FP32's is above the float32 max as a double
    body = b'{"inputs":[{"name":"x","datatype":"%s","shape":[%d],"data":%s}]}' % (
        datatype.encode(),
        len(data),
        orjson.dumps(data),
    )
    got = decode_request(body, None).inputs["x"]
    assert got.dtype == dtype
    assert got.tobytes() == np.array(data, dtype=np.float64).astype(dtype).tobytes()


# Per float type: the largest magnitude still in range (it rounds to the type's largest
# value) and the least one refused (it rounds to infinity).
_EDGES = {
    "FP16": (65519.99, 65520.0, 65504.0),  # and the type's largest value
    "FP32": (3.4028235677973362e38, 3.4028235677973366e38, 3.4028234663852886e38),
}


@pytest.mark.parametrize("datatype", list(_EDGES))
@pytest.mark.parametrize(
    "layout",
    [
        lambda x: ([x, 1.0], [2]),  # flat, a float first (struct packs it)
        lambda x: ([1, x], [2]),  # an int first (numpy reads it)
        lambda x: ([[1.0, x]], [1, 2]),  # nested
        lambda x: ([-x, 1.0], [2]),
    ],
    ids=["flat", "int-first", "nested", "negative"],
)
def test_one_range_rule_for_floats_whatever_the_layout(
    datatype: str, layout: Callable[[float], tuple[list[Any], list[int]]]
) -> None:
    inside, outside, largest = _EDGES[datatype]
    for value, in_range in ((inside, True), (outside, False)):
        data, shape = layout(value)
        body = b'{"inputs":[{"name":"x","datatype":"%s","shape":%s,"data":%s}]}' % (
            datatype.encode(),
            orjson.dumps(shape),
            orjson.dumps(data),
        )
        if in_range:
            got = decode_request(body, None).inputs["x"]
            assert np.isfinite(got).all()
            assert float(np.abs(got).max()) == largest
        else:
            with pytest.raises(BadRequest, match=f"out of range for {datatype}"):
                decode_request(body, None)


def test_binary_output_bytes_are_little_endian_and_row_major_whatever_the_array() -> None:
    native = np.arange(6, dtype=np.float32).reshape(2, 3)
    expected = native.astype("<f4").tobytes()
    assert to_wire(native) == expected
    assert to_wire(native.astype(">f4")) == expected  # big-endian in memory
    assert to_wire(np.asfortranarray(native)) == expected  # column-major in memory
    wide = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert to_wire(wide[:, ::2]) == wide[:, ::2].copy().astype("<f4").tobytes()  # strided view
    back = from_wire(expected, "FP32", (2, 3))
    np.testing.assert_array_equal(back, native)


def test_json_outputs_read_back_exactly_in_their_own_type_whatever_the_array() -> None:
    values = np.array([0.1, -1e-45, 3.4e38, 1 / 3, 0.0, 7.0], dtype=np.float32).reshape(2, 3)
    decoded = decode_request(
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}', None
    )
    for array in (
        values,
        values.astype(">f4"),  # big-endian in memory
        np.asfortranarray(values),  # column-major
        np.repeat(values, 2, axis=1)[:, ::2],  # a strided view
    ):
        body, json_len = encode_response("m", 1, {"y": array}, decoded)
        assert json_len is None
        data = orjson.loads(body)["outputs"][0]["data"]
        np.testing.assert_array_equal(np.array(data, dtype=np.float32), values.reshape(-1))
        # each FP32 value in the shortest text that is that FP32 value (as an FP32 is
        # read), not the text of the double it widens to (0.10000000149011612)
        assert b'"data":[0.1,-1e-45,3.4e+38,0.33333334,0.0,7.0]' in body
    halves, _ = encode_response("m", 1, {"h": np.array([0.1], np.float16)}, decoded)
    assert np.float16(orjson.loads(halves)["outputs"][0]["data"][0]) == np.float16(0.1)
    flags, _ = encode_response("m", 1, {"b": np.array([True, False])}, decoded)
    assert b'"data":[true,false]' in flags
