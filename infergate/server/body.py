"""Reading a request body under the size limit, inflating gzip and deflate as it arrives.

A compressed body is inflated step by step and refused the moment its inflated size
passes the limit: a small gzip bomb (a megabyte that inflates to gigabytes) costs the
gateway no more memory than an honest body at the limit. The inflation runs in steps of
at most `_STEP` bytes of output with the event loop served in between, so even a body
inflated at the limit never holds up health checks or other clients for long.
"""

from __future__ import annotations

import asyncio
import zlib

from starlette.types import Receive

from infergate.errors import BadRequest, PayloadTooLarge

_STEP = 1 << 20  # inflated bytes per step between two turns of the event loop
_GZIP_MAGIC = b"\x1f\x8b"


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


class _Inflater:
    """gzip (one or more members) or zlib-wrapped deflate, with a bound on the output."""

    def __init__(self, encoding: str, limit: int) -> None:
        self._encoding = encoding
        self._wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        self._stream = zlib.decompressobj(self._wbits)
        self._limit = limit
        self.size = 0
        self.chunks: list[bytes] = []

    async def feed(self, data: bytes) -> None:
        while data:
            try:
                piece = self._stream.decompress(data, _STEP)
            except zlib.error as exc:
                raise self._corrupt(str(exc)) from None
            self.size += len(piece)
            if self.size > self._limit:
                raise too_big(self._limit)
            self.chunks.append(piece)
            data = self._stream.unconsumed_tail
            if self._stream.eof and self._stream.unused_data:
                data = self._stream.unused_data
                if self._encoding != "gzip" or not data.startswith(_GZIP_MAGIC):
                    raise self._corrupt("data follows the end of the compressed stream")
                self._stream = zlib.decompressobj(self._wbits)  # the next gzip member
            if data:
                await asyncio.sleep(0)  # let the loop answer others between steps

    def finish(self) -> bytes:
        if not self._stream.eof:
            raise self._corrupt("the body ends before the compressed stream does")
        return b"".join(self.chunks)

    def _corrupt(self, why: str) -> BadRequest:
        return BadRequest(
            f"body says Content-Encoding {self._encoding} but does not decompress: {why}"
        )


async def read_body(headers: dict[bytes, bytes], receive: Receive, limit: int) -> bytes | bytearray:
    """The whole body, inflated; 413 as soon as it (raw or inflated) passes `limit`."""
    declared = headers.get(b"content-length")
    length = int(declared) if declared is not None and declared.isdigit() else None
    if length is not None and length > limit:
        raise too_big(limit)
    encoding = content_encoding(headers) if b"content-encoding" in headers else ""
    inflater = _Inflater(encoding, limit) if encoding in ("gzip", "deflate") else None
    if inflater is None and length is not None and length > _STEP:
        return await _read_into(bytearray(length), receive)
    chunks: list[bytes] = []
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
        more = message.get("more_body", False)
        if inflater is not None:
            await inflater.feed(chunk)
        else:
            chunks.append(chunk)
    if inflater is not None:
        return inflater.finish()
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_into(body: bytearray, receive: Receive) -> bytearray:
    """A large body of known length, copied piece by piece as it arrives: joining tens of
    megabytes at the end would hold the event loop for one long copy."""
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client went away before sending the whole body")
        chunk = message.get("body", b"")
        if size + len(chunk) > len(body):  # (a slice assignment would grow the buffer)
            raise BadRequest(f"the body is longer than its Content-Length of {len(body)}")
        body[size : size + len(chunk)] = chunk
        size += len(chunk)
        more = message.get("more_body", False)
    if size != len(body):  # the HTTP parser holds a body to its Content-Length
        raise BadRequest(f"the body has {size} bytes but Content-Length says {len(body)}")
    return body
