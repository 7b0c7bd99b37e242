"""KServe V2 datatypes and their numpy counterparts, and the BYTES wire format.

Shared by the HTTP codec, the worker transport and the client, so there is one
definition of how a tensor looks as bytes.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Final

import numpy as np
import numpy.typing as npt

V2_TO_NUMPY: Final[dict[str, np.dtype[np.generic]]] = {
    "BOOL": np.dtype(np.bool_),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

# Native numpy dtypes to their V2 datatype: every one but BYTES (an object array).
NUMPY_TO_V2: Final[dict[np.dtype[np.generic], str]] = {
    dt: name for name, dt in V2_TO_NUMPY.items() if name != "BYTES"
}

Array = npt.NDArray[np.generic]


def v2_datatype(dtype: np.dtype[np.generic]) -> str:
    """The V2 datatype name of a numpy dtype; strings and bytes are BYTES."""
    name = NUMPY_TO_V2.get(dtype)
    if name is not None:
        return name
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return NUMPY_TO_V2[dtype.newbyteorder("=")]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no KServe V2 datatype") from None


_LITTLE_ENDIAN_HOST: Final = sys.byteorder == "little"

# The little-endian dtype each fixed-size datatype travels as on the wire.
_WIRE_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    name: dt.newbyteorder("<") for name, dt in V2_TO_NUMPY.items() if name != "BYTES"
}
WIRE_DTYPES: Final = _WIRE_DTYPES  # for readers of fixed-size tensors with no checks to make


def numpy_dtype(datatype: str) -> np.dtype[np.generic]:
    try:
        return V2_TO_NUMPY[datatype]
    except KeyError:
        known = ", ".join(V2_TO_NUMPY)
        raise ValueError(f"unknown datatype {datatype!r}; expected one of {known}") from None


def _as_bytes(item: object) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    return str(item).encode("utf-8")


def serialize_bytes(array: Array) -> bytes:
    """BYTES tensor → each element as a 4-byte little-endian length, then its bytes."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        raw = _as_bytes(item)
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def read_bytes_elements(view: memoryview, offset: int, limit: int) -> tuple[list[bytes], int]:
    """Up to `limit` BYTES elements from `offset` on: the elements, and the offset after
    them (so a long tensor can be read a slice at a time)."""
    items: list[bytes] = []
    end = len(view)
    while offset < end and len(items) < limit:
        if offset + 4 > end:
            raise ValueError("BYTES data ends inside an element's 4-byte length prefix")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > end:
            raise ValueError(
                f"the BYTES element at byte {offset - 4} claims {length} bytes but only "
                f"{end - offset} remain"
            )
        items.append(bytes(view[offset : offset + length]))
        offset += length
    return items, offset


def deserialize_bytes(buffer: bytes | memoryview, count: int | None = None) -> Array:
    """Inverse of serialize_bytes; a flat object array of bytes."""
    view = memoryview(buffer)
    items, offset = read_bytes_elements(view, 0, len(view) if count is None else count)
    if offset != len(view):
        raise ValueError(f"{len(view) - offset} bytes left over after {len(items)} BYTES elements")
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def to_wire(array: Array) -> bytes:
    """Raw bytes of a tensor as the binary data extension carries it (little-endian)."""
    dtype = array.dtype
    if dtype.kind in ("O", "S", "U"):
        return serialize_bytes(array)
    if _LITTLE_ENDIAN_HOST and dtype.byteorder != ">":  # the usual case: no conversion
        return array.tobytes()
    return array.astype(dtype.newbyteorder("<")).tobytes()


def from_wire(buffer: bytes | memoryview, datatype: str, shape: tuple[int, ...]) -> Array:
    """A tensor from raw bytes; raises ValueError naming the size mismatch."""
    count = math.prod(shape)
    if datatype == "BYTES":
        # No more elements read than the shape needs: 1 MB of zero-length elements is
        # 250,000 of them, built before the count was compared (0.1 s of the event loop).
        view = memoryview(buffer)
        items, offset = read_bytes_elements(view, 0, count)
        if offset != len(view):  # more elements, or bytes that are none
            raise ValueError(
                f"has {len(view) - offset} bytes left over after the {count} BYTES elements "
                f"shape {list(shape)} needs"
            )
        if len(items) != count:
            raise ValueError(
                f"holds {len(items)} BYTES elements but shape {list(shape)} needs {count}"
            )
        flat = np.empty(count, dtype=object)
        flat[:] = items
        return flat.reshape(shape)
    dtype = _WIRE_DTYPES.get(datatype) or numpy_dtype(datatype).newbyteorder("<")
    expected = count * dtype.itemsize
    if len(buffer) != expected:
        raise ValueError(
            f"has {len(buffer)} bytes of data but shape {list(shape)} of {datatype} "
            f"needs {expected}"
        )
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)
