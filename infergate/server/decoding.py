"""Decoding infer bodies without holding up the event loop.

A small body decodes inline: that is the common case and the fastest. A large one would
hold the loop for as long as it takes (a 60 MB JSON body: about a second on a small
machine), and health checks and every other client would wait behind it.

Threads alone do not fix that: orjson, numpy's list conversion and pickle hold the GIL
for a whole call, and a single 60 MB copy takes 50 ms here. So a large JSON body is
decoded in a helper process, and nothing large crosses as one call: the body goes over in
a shared-memory segment filled a few megabytes at a time from a thread, and the tensors
come back the same way (numbers as raw arrays, BYTES in their length-prefixed wire form).
Each step holds the GIL for a few milliseconds at most, so the loop keeps answering.
The tensors of a large binary request are cut out in a thread: views, and a Python loop
over BYTES elements, which gives the GIL back every few milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import multiprocessing
import os
import secrets
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import numpy as np

from infergate.engine.workers.shm import MappedArena, OwnedArena
from infergate.errors import InfergateError
from infergate.server.codec import Body, DecodedRequest, decode_request
from infergate.tensors import Array, from_wire, serialize_bytes

INLINE_MAX_BYTES = 1 << 20  # bodies up to this size decode on the event loop
_CHUNK = 4 << 20  # bytes per copy: a few milliseconds of holding the GIL


class _Tensor(NamedTuple):
    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int
    size: int


class _Decoded(NamedTuple):
    """What the helper hands back: the request without its tensors, and where they lie."""

    request: DecodedRequest
    segment: str
    tensors: tuple[_Tensor, ...]


def _copy(dst: memoryview, src: memoryview) -> None:
    for start in range(0, len(src), _CHUNK):
        dst[start : start + _CHUNK] = src[start : start + _CHUNK]


def _decode_in_helper(segment: str, size: int, header_length: str | None) -> _Decoded:
    """Runs in the helper process: decode the body in `segment`, write the tensors to a
    new segment (made here, outside multiprocessing's tracker: the gateway unlinks it)."""
    body = MappedArena(segment)
    try:
        decoded = decode_request(body.buf[:size], header_length)
    finally:
        body.close()
    blobs: list[tuple[str, str, tuple[int, ...], memoryview | bytes]] = []
    for name, array in decoded.inputs.items():
        if array.dtype.kind == "O":
            blobs.append((name, "BYTES", array.shape, serialize_bytes(array)))
        else:
            data = np.ascontiguousarray(array)
            raw = data.data.cast("B") if data.size else b""  # (cast refuses empty shapes)
            blobs.append((name, str(data.dtype), data.shape, raw))
    out_name = f"infergate-decode-{os.getpid()}-{secrets.token_hex(6)}"
    total = max(1, sum(len(b) for *_, b in blobs))
    fd = os.open(f"/dev/shm/{out_name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
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
    return _Decoded(decoded._replace(inputs={}), out_name, tuple(tensors))


def _body_to_segment(body: Body) -> OwnedArena:
    arena = OwnedArena(len(body))
    _copy(arena.buf, memoryview(body))
    return arena


def _tensors_from_segment(decoded: _Decoded) -> DecodedRequest:
    segment = MappedArena(decoded.segment)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{decoded.segment}")  # the mapping outlives the name
    inputs: dict[str, Array] = {}
    try:
        for t in decoded.tensors:
            piece = segment.buf[t.offset : t.offset + t.size]
            if t.datatype == "BYTES":
                inputs[t.name] = from_wire(piece, "BYTES", t.shape)
            else:
                array = np.empty(t.shape, dtype=np.dtype(t.datatype))
                if array.size:
                    _copy(array.data.cast("B"), piece)
                inputs[t.name] = array
            piece.release()
    finally:
        segment.close()
    return decoded.request._replace(inputs=inputs)


def _start_helper() -> None:
    os.nice(5)  # the gateway's loop (health, small requests) goes before a big decode


class BodyDecoder:
    def __init__(self, inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self._inline_max = inline_max_bytes
        self._pool: ProcessPoolExecutor | None = None

    async def decode(self, body: Body, header_length: str | None) -> DecodedRequest:
        if len(body) <= self._inline_max:
            return decode_request(body, header_length)
        if header_length is not None:  # binary tensors: views and loops, fine in a thread
            return await asyncio.to_thread(decode_request, body, header_length)
        arena = await asyncio.to_thread(_body_to_segment, body)
        try:
            decoded = await asyncio.get_running_loop().run_in_executor(
                self._helper(), _decode_in_helper, arena.name, len(body), header_length
            )
        except BrokenProcessPool:
            self._pool = None  # a new helper for the next large body
            raise InfergateError("the body decoder process died; retry the request") from None
        finally:
            arena.close()
        return await asyncio.to_thread(_tensors_from_segment, decoded)

    def _helper(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_helper,
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
