"""Large answers finished without holding up the event loop.

A 60 MB FP32 tensor answered as JSON is about 160 MB of text: orjson wrote it in one call
of 0.9 s on the event loop, and gzip (asked for by tritonclient's aio client, httpx and
browsers on every request) compressed it in 3 s more, while health checks and every other
client waited. orjson and numpy's copies hold the GIL, so a thread would not help them;
zlib and `bytes.join` let go of it. So an answer whose tensors hold more than
encoding.AT_ONCE_BYTES (LargeAnswer) is encoded here in slices of about a millisecond,
the loop serving others between two, into pieces that a thread then joins or compresses
(compression.CompressLater: a body too large to compress on the loop goes the same way).
The answer is the same, byte for byte, as `encode_response` and `compress_response` give.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson

from infergate.engine.triton.shared_memory import SYSTEM_SHM, wants_shared_memory
from infergate.server.codec import DecodedRequest
from infergate.server.compression import compress_pieces
from infergate.server.encoding import _json_data, _json_text
from infergate.tensors import Array, to_wire, v2_datatype

# What one slice encodes: JSON numbers, a millisecond or so of orjson (32,768 FP32 numbers
# at 30 to 40 ns each); binary numbers, a copy of a megabyte; BYTES elements (Python
# objects, each its own call), a few milliseconds.
_JSON_SLICE_BYTES = 128 << 10
_BINARY_SLICE_BYTES = 1 << 20
_OBJECTS_SLICE = 2048
# Pieces joined on the loop when no larger than this (the thread's turn costs more);
# a larger join runs on the thread, where bytes.join lets go of the GIL.
_JOIN_HERE = 1 << 20


@functools.cache
def _thread() -> ThreadPoolExecutor:
    """The threads that join and compress large answers: two, so that a long one (160 MB
    of gzip: 2.4 s) does not hold up every other; at nice 5, as the body decoder's helper
    process, so that the event loop goes first on a busy machine."""
    return ThreadPoolExecutor(
        max_workers=2, thread_name_prefix="ig-answer", initializer=_lower_priority
    )


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # (Linux: a thread's own priority)
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + 5)


def _slice_length(array: Array, slice_bytes: int) -> int:
    """Elements of `array` a slice holds."""
    if array.dtype.kind in ("O", "S", "U"):
        return _OBJECTS_SLICE
    return max(1, slice_bytes // max(1, array.dtype.itemsize))


def _slices(array: Array, slice_bytes: int) -> Iterator[tuple[int, Array]]:
    """`array`'s elements in C order, a slice at a time (where it starts, the slice): a
    view of the array where it is C-contiguous, else a copy of the slice alone (never of
    the whole)."""
    step = _slice_length(array, slice_bytes)
    flat = array.reshape(-1) if array.flags.c_contiguous else None
    for start in range(0, array.size, step):
        stop = min(start + step, array.size)
        yield start, (flat[start:stop] if flat is not None else array.flat[start:stop])


async def encode_in_slices(
    model: str, version: int, outputs: dict[str, Array], request: DecodedRequest
) -> tuple[list[bytes], int | None]:
    """`encoding.encode_response`'s answer as pieces to join (`finish`), and the JSON header
    length when binary outputs follow it. orjson writes JSON compactly, in the order of
    the keys, so the document is written as the pieces of what it writes in one go."""
    head = orjson.dumps({"model_name": model, "model_version": str(version)})
    header = [head[:-1], b',"outputs":[']
    blobs: list[bytes] = []
    binary = False  # (an empty binary output has no blob, but makes the answer binary)
    extra = request.output_parameters
    for index, (name, array) in enumerate(outputs.items()):
        if index:
            header.append(b",")
        entry = {"name": name, "datatype": v2_datatype(array.dtype), "shape": list(array.shape)}
        if extra and wants_shared_memory(shm := extra.get(name)):
            SYSTEM_SHM.write_output(name, array, shm)  # no parameters: nothing follows
            header.append(orjson.dumps(entry))
        elif request.binary_by_default or name in request.binary_outputs:
            binary, size = True, 0
            for _, piece in _slices(array, _BINARY_SLICE_BYTES):
                blob = to_wire(piece)  # (BYTES: each element its length, then itself)
                blobs.append(blob)
                size += len(blob)
                await asyncio.sleep(0)  # the loop serves others between two slices
            header.append(orjson.dumps({**entry, "parameters": {"binary_data_size": size}}))
        elif array.dtype.kind in ("O", "S", "U"):
            header += (orjson.dumps(entry)[:-1], b',"data":[')
            await _strings_as_json(name, array, header)
            header.append(b"]}")
        else:
            header += (orjson.dumps(entry)[:-1], b',"data":[')
            first = True
            for start, piece in _slices(array, _JSON_SLICE_BYTES):
                text = orjson.dumps(_json_data(name, piece, start), option=_NUMPY)
                if not first:
                    header.append(b",")
                header.append(text[1:-1])  # (its own brackets off)
                first = False
                await asyncio.sleep(0)
            header.append(b"]}")
    header.append(b"]")
    if request.id is not None:
        header += (b',"id":', orjson.dumps(request.id))
    header.append(b"}")
    if not binary:
        return header, None
    return header + blobs, sum(map(len, header))


_NUMPY = orjson.OPT_SERIALIZE_NUMPY


async def _strings_as_json(name: str, array: Array, out: list[bytes]) -> None:
    """A BYTES output's elements as JSON strings, comma-separated, into `out`, a turn of
    the loop given up every _JSON_SLICE_BYTES of text or _OBJECTS_SLICE elements. A string
    longer than a slice is written in pieces: JSON escapes each character alone, so the
    pieces of a string, each written by orjson without its quotes, make the string as
    orjson writes it whole (an echo of two 28 MB strings held the loop 0.6 s in one go)."""
    since = 0  # text written since the last turn given up
    for index, item in enumerate(array.reshape(-1)):
        if index:
            out.append(b",")
        text = _json_text(name, index, item)  # (the 400 for bytes that are not UTF-8)
        if len(text) <= _JSON_SLICE_BYTES:
            out.append(orjson.dumps(text))
            since += len(text) + 1
        else:
            out.append(b'"')
            for at in range(0, len(text), _JSON_SLICE_BYTES):
                out.append(orjson.dumps(text[at : at + _JSON_SLICE_BYTES])[1:-1])
                await asyncio.sleep(0)
            out.append(b'"')
            since = 0
        if since >= _JSON_SLICE_BYTES or index % _OBJECTS_SLICE == _OBJECTS_SLICE - 1:
            since = 0
            await asyncio.sleep(0)


async def finish(pieces: list[bytes], coding: str | None) -> bytes:
    """The body that `pieces` join into, compressed with `coding` (gzip, deflate) unless
    None, on a thread; the pieces are let go of there (the list is emptied)."""
    if coding is None and sum(map(len, pieces)) <= _JOIN_HERE:
        body = b"".join(pieces)
        pieces.clear()
        return body
    return await asyncio.wrap_future(_thread().submit(_join_or_compress, pieces, coding))


def _join_or_compress(pieces: list[bytes], coding: str | None) -> bytes:
    try:
        return b"".join(pieces) if coding is None else compress_pieces(pieces, coding)
    finally:
        pieces.clear()  # (hundreds of pieces of a megabyte: freed here, not on the loop)
