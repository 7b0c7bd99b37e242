"""Reading a request body under the size limit, inflating gzip and deflate as it arrives.

A compressed body is inflated step by step and refused the moment its inflated size
passes the limit: a small gzip bomb (a megabyte that inflates to gigabytes) costs the
gateway no more memory than an honest body at the limit. The inflation runs in steps of
at most `_STEP` bytes of output with the event loop served in between, so even a body
inflated at the limit never holds up health checks or other clients for long.

A large body never holds up the loop in one go either. Its pieces are copied, as they
arrive, into one anonymous memory mapping: nothing is zero-filled first (a bytearray of
60 MB writes 60 MB of zeros before the body's first byte: 40 to 130 ms on a small busy
machine) and nothing is joined at the end (one copy of the whole). Each page is touched
once, by the piece that lands on it. Freeing tens of megabytes takes 10 to 30 ms as well,
so such a buffer is let go with `free_off_loop`: on a thread of its own, where the unmap
runs with the GIL released. Small bodies, the common case, stay plain bytes.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.types import Message, Receive

from infergate.errors import BadRequest, PayloadTooLarge
from infergate.server.codec import Body

_STEP = 1 << 20  # inflated bytes per step between two turns of the event loop
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_LENGTH_DIGITS = 19  # the longest length a 64-bit count holds


def too_big(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body is over the {limit / 2**20:g} MB limit. Hint: send smaller batches or "
        "raise max_request_mb in the profile's [server] table"
    )


def content_encoding(headers: dict[bytes, bytes]) -> str:
    raw = headers.get(b"content-encoding", b"")
    encoding = raw.decode("latin-1").strip().lower()
    if encoding not in ("", "identity", "gzip", "deflate"):
        raise BadRequest(
            f"Content-Encoding {encoding!r} is not supported; use gzip or deflate (or none)"
        )
    return encoding


def anonymous_mapping(size: int) -> mmap.mmap:
    """`size` bytes of fresh memory whose pages are zeroed only when first touched, and
    which `free_off_loop` can unmap without the GIL. Private: a shared anonymous mapping
    is shmem, whose pages cost more to fault in and to free."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@functools.cache
def _freer() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="ig-free")


def free_off_loop(held: list[Any]) -> None:
    """Drop the items of `held` on the freeing thread: where one is the last reference to
    a large mapping (or an array or view of one), the unmap happens there, with the GIL
    released, and not on the event loop. The caller keeps no other reference to them
    (only to the list, which the thread empties)."""
    _freer().submit(held.clear)


class _Pieces:
    """A body's pieces as they arrive: a list while small, joined at the end; past
    `_STEP` (or from the start, for a length known to be larger), copied into one
    anonymous mapping that doubles when full (mremap: no copy)."""

    def __init__(self, expected: int | None = None) -> None:
        self.size = 0
        self._small: list[bytes] = []
        self._map = anonymous_mapping(expected) if expected and expected > _STEP else None

    def add(self, piece: bytes) -> None:
        end = self.size + len(piece)
        if self._map is None and end > _STEP:
            self._map = anonymous_mapping(2 * _STEP)
            self._map[: self.size] = b"".join(self._small)  # at most _STEP bytes
            self._small = []
        if self._map is None:
            self._small.append(piece)
        else:
            if end > len(self._map):
                self._map.resize(max(end, 2 * len(self._map)))
            self._map[self.size : end] = piece
        self.size = end

    def take(self) -> Body:
        """The body, handed over: bytes, or a view of the mapping (let go of it with
        free_off_loop)."""
        if self._map is None:
            return self._small[0] if len(self._small) == 1 else b"".join(self._small)
        whole = memoryview(self._map)
        self._map = None
        return whole[: self.size] if self.size < len(whole) else whole

    def discard(self) -> None:
        """Let go of what was read (a body refused halfway), off the loop."""
        self._small = []
        if self._map is not None:
            held = [self._map]
            self._map = None
            free_off_loop(held)


class _Inflater:
    """gzip (one or more members) or zlib-wrapped deflate, with a bound on the output."""

    def __init__(self, encoding: str, limit: int) -> None:
        self._encoding = encoding
        self._wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        self._stream = zlib.decompressobj(self._wbits)
        self._limit = limit
        self.pieces = _Pieces()

    async def feed(self, data: bytes) -> None:
        while data:
            try:
                piece = self._stream.decompress(data, _STEP)
            except zlib.error as exc:
                raise self._corrupt(str(exc)) from None
            if self.pieces.size + len(piece) > self._limit:
                raise too_big(self._limit)
            self.pieces.add(piece)
            data = self._stream.unconsumed_tail
            if self._stream.eof and self._stream.unused_data:
                data = self._stream.unused_data
                if self._encoding != "gzip" or not data.startswith(_GZIP_MAGIC):
                    raise self._corrupt("data follows the end of the compressed stream")
                self._stream = zlib.decompressobj(self._wbits)  # the next gzip member
            if data:
                await asyncio.sleep(0)  # let the loop answer others between steps

    def finish(self) -> None:
        if not self._stream.eof:
            raise self._corrupt("the body ends before the compressed stream does")

    def _corrupt(self, why: str) -> BadRequest:
        return BadRequest(
            f"body says Content-Encoding {self._encoding} but does not decompress: {why}"
        )


def body_headers(headers: dict[bytes, bytes], limit: int) -> tuple[int | None, str]:
    """A body's Content-Length (None: not given) and Content-Encoding ("" for none), as
    `read_body` takes them; its 400 or 413 from the headers alone."""
    declared = headers.get(b"content-length")
    length = None
    if declared is not None and declared.isdigit():
        if len(declared) > _MAX_LENGTH_DIGITS:  # (zeros first): int() would refuse it
            raise BadRequest(
                f"Content-Length has {len(declared)} digits; a length has at most "
                f"{_MAX_LENGTH_DIGITS}"
            )
        length = int(declared)
    if length is not None and length > limit:
        raise too_big(limit)
    encoding = content_encoding(headers) if b"content-encoding" in headers else ""
    return length, encoding


async def read_body(headers: dict[bytes, bytes], receive: Receive, limit: int) -> Body:
    """The whole body, inflated; 413 as soon as it (raw or inflated) passes `limit`. A
    large one is a view of an anonymous mapping (see the module docstring)."""
    length, encoding = body_headers(headers, limit)
    inflater = _Inflater(encoding, limit) if encoding in ("gzip", "deflate") else None
    if inflater is None and length is not None and length <= _STEP:
        # Most bodies are small and come whole in the first message: taken as they are.
        first = await receive()
        if first["type"] == "http.request" and not first.get("more_body", False):
            body: bytes = first.get("body", b"")
            if len(body) == length:
                return body
        receive = _again(first, receive)
    pieces = _Pieces(length) if inflater is None else inflater.pieces
    try:
        await _receive_all(receive, limit, length, inflater, pieces)
    except BaseException:
        pieces.discard()
        raise
    return pieces.take()


def _again(first: Message, receive: Receive) -> Receive:
    """`receive`, with `first` (already taken from it) handed out once more first."""
    taken = [first]

    async def replay() -> Message:
        return taken.pop() if taken else await receive()

    return replay


async def _receive_all(
    receive: Receive,
    limit: int,
    length: int | None,
    inflater: _Inflater | None,
    pieces: _Pieces,
) -> None:
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client went away before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_big(limit)
        if length is not None and size > length:  # (the HTTP parser prevents it)
            raise BadRequest(f"the body is longer than its Content-Length of {length}")
        more = message.get("more_body", False)
        if inflater is not None:
            await inflater.feed(chunk)
        else:
            pieces.add(chunk)
    if inflater is not None:
        inflater.finish()
    elif length is not None and size != length:  # the HTTP parser holds a body to it
        raise BadRequest(f"the body has {size} bytes but Content-Length says {length}")
