"""The body decoder's helper process and the shared-memory segments it works through.

What runs in the helper (decode a large JSON body, or read a remote model's request
header from it) and the segment files that carry a body there and its tensors back:
numbers as raw arrays, BYTES in their length-prefixed wire form. The segments are files
in /dev/shm written and read with plain write and read calls on the gateway's I/O
thread, never mapped by the gateway: the copies, the page faults, and the freeing of tens
of megabytes at unlink (munmap and unlink of a 60 MB segment: tens of milliseconds, more
on a busy machine) all happen there, with the GIL released. What calls the helper, and
when, is server/decoding.py.

The helper's functions are module-level: the process pool pickles them by name.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import secrets
from typing import Any, NamedTuple

import numpy as np

from infergate.engine.triton.shared_memory import DECODE_SEGMENT_PREFIX
from infergate.engine.workers.shm import MappedArena
from infergate.errors import InfergateError, TooDeep
from infergate.server.body import anonymous_mapping
from infergate.server.codec import (
    Body,
    DecodedRequest,
    check_json_values,
    decode_request,
    pass_through_header,
)
from infergate.tensors import Array, serialize_bytes


class _Tensor(NamedTuple):
    name: str
    datatype: str  # a numpy dtype string ("<f4"), or "BYTES"
    shape: tuple[int, ...]
    offset: int
    size: int


class Decoded(NamedTuple):
    """What the helper hands back: the request without its tensors, and where they lie."""

    request: DecodedRequest
    segment: str
    tensors: tuple[_Tensor, ...]


def decode_in_helper(
    segment: str, size: int, header_length: str | None, max_strings: int
) -> Decoded:
    """Runs in the helper process: decode the body in `segment`, write the tensors to a
    new segment (made here, outside multiprocessing's tracker: the gateway unlinks it as
    soon as it has mapped it)."""
    body = MappedArena(segment)
    try:
        check_json_values(_json_part(body, size, header_length), max_strings)
        decoded = decode_request(body.buf[:size], header_length, max_strings=max_strings)
        request = decoded._replace(inputs={})
        try:  # (small without its tensors: its ids, names and parameters)
            pickle.dumps(request, pickle.HIGHEST_PROTOCOL)
        except RecursionError:
            raise TooDeep() from None
        name, tensors = _write_tensors(decoded.inputs)
        del decoded  # binary tensors are views of the body's mapping
    finally:
        with contextlib.suppress(BufferError):  # a view still held (an error's frames)
            body.close()
    return Decoded(request, name, tensors)


def pass_through_header_in_helper(
    segment: str, size: int, header_length: str | None, max_strings: int
) -> dict[str, Any] | None:
    """Runs in the helper process: a remote model's request header, read from `segment`."""
    body = MappedArena(segment)
    try:
        check_json_values(_json_part(body, size, header_length), max_strings)
        return pass_through_header(body.buf[:size], header_length)
    finally:
        with contextlib.suppress(BufferError):
            body.close()


def _json_part(body: MappedArena, size: int, header_length: str | None) -> memoryview:
    # (The gateway checked the header length before handing the body over.)
    return body.buf[: size if header_length is None else int(header_length)]


def _write_tensors(inputs: dict[str, Array]) -> tuple[str, tuple[_Tensor, ...]]:
    blobs: list[tuple[str, str, tuple[int, ...], memoryview | bytes]] = []
    for name, array in inputs.items():
        if array.dtype.kind == "O":
            blobs.append((name, "BYTES", array.shape, serialize_bytes(array)))
        else:
            data = np.ascontiguousarray(array)
            raw = data.data.cast("B") if data.size else b""  # (cast refuses empty shapes)
            blobs.append((name, data.dtype.str, data.shape, raw))
    segment = f"{DECODE_SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    total = max(1, sum(len(blob) for *_, blob in blobs))
    fd = os.open(f"/dev/shm/{segment}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total) as out:
            tensors = []
            offset = 0
            view = memoryview(out)
            for name, datatype, shape, blob in blobs:
                view[offset : offset + len(blob)] = blob
                tensors.append(_Tensor(name, datatype, shape, offset, len(blob)))
                offset += len(blob)
            view.release()
    finally:
        os.close(fd)
    return segment, tuple(tensors)


def _segment_path(segment: str) -> str:
    return f"/dev/shm/{segment}"


def write_segment(segment: str, body: Body) -> None:
    """On the I/O thread: the body into a new segment (os.write lets go of the GIL)."""
    fd = os.open(_segment_path(segment), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(body).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
    finally:
        os.close(fd)


def unlink_segment(segment: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_segment_path(segment))


Raw = dict[str, Array | mmap.mmap]


def read_segment(decoded: Decoded) -> Raw:
    """On the I/O thread: the helper's tensors out of its segment, which goes away
    (numbers as arrays of their dtype, BYTES as their wire form, for the loop to split).
    Each lands in an anonymous mapping of its own, so that it can be freed off the loop
    too (see decoding.Keeper)."""
    fd = os.open(_segment_path(decoded.segment), os.O_RDONLY)
    try:
        os.unlink(_segment_path(decoded.segment))  # its pages go when fd closes, here
        raw: Raw = {}
        for t in decoded.tensors:
            if t.size == 0:  # (a mapping cannot be empty)
                raw[t.name] = _empty(t)
                continue
            target = anonymous_mapping(t.size)
            view = memoryview(target)
            if t.datatype == "BYTES":
                raw[t.name] = target
            else:
                dtype = np.dtype(t.datatype)
                array = np.frombuffer(target, dtype, t.size // dtype.itemsize)
                raw[t.name] = array.reshape(t.shape)
            done = 0
            while done < t.size:
                got = os.preadv(fd, [view[done:]], t.offset + done)
                if got == 0:
                    raise InfergateError(f"the body decoder's segment ended inside {t.name!r}")
                done += got
            view.release()
    finally:
        os.close(fd)
    return raw


def _empty(t: _Tensor) -> Array | mmap.mmap:
    if t.datatype == "BYTES":
        return anonymous_mapping(1)  # (read as a view of its first 0 bytes)
    return np.empty(t.shape, dtype=np.dtype(t.datatype))
