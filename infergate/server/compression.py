"""Compressed responses, when the client's Accept-Encoding asks for gzip or deflate (as
tritonclient's `response_compression_algorithm` does) and the body is worth it."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable

from infergate.errors import CompressLater

# Fast: the point is fewer bytes on a slow link, not the smallest body. zlib's level 1
# on 160 MB of JSON FP32 numbers: 2.4 s of CPU for 47% of the size, where level 6 took
# 5 times as long for 42%, and level 9 20 times as long (a 2-core machine).
_LEVEL = 1
# Smaller bodies go as they are (as nginx's gzip_min_length): compressing them saves
# almost nothing, and httpx, curl --compressed and browsers ask for gzip on every request.
MIN_BYTES = 1024
# The largest body compressed on the event loop: 1 to 4 ms at level 1 (JSON numbers
# compress at 60 to 140 MB/s on a small machine, binary FP32 at about 30). A larger one
# is compressed on a thread, where zlib lets go of the GIL (server/large_answers.py).
ON_LOOP_MAX_BYTES = 128 << 10


def _chosen(accept: str) -> str | None:
    """gzip or deflate, whichever the header lists first with a non-zero q."""
    for part in accept.split(","):
        coding, _, rest = part.strip().partition(";")
        coding = coding.strip().lower()
        if coding not in ("gzip", "deflate"):
            continue
        q = rest.strip().removeprefix("q=") if rest.strip().startswith("q=") else "1"
        try:
            if float(q) > 0:
                return coding
        except ValueError:
            continue
    return None


def accepted_coding(request_headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The coding a request's Accept-Encoding asks answers in: gzip, deflate or None."""
    for key, value in request_headers:  # ASGI header names are lower case
        if key == b"accept-encoding":
            return _chosen(value.decode("latin-1"))
    return None


def compress_response(
    request_headers: Iterable[tuple[bytes, bytes]],
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    status: int,
    most: int | None = None,
) -> bytes:
    """The body to send, compressed (and Content-Encoding added) when the client asked.
    Errors go as they are: tritonclient.http.aio reads them before it decompresses.
    `most`: the largest body to compress here; CompressLater for a larger one."""
    if status != 200 or len(body) < MIN_BYTES:  # first: most answers stop here
        return body
    coding = accepted_coding(request_headers)
    if coding is None:
        return body
    if most is not None and len(body) > most:
        raise CompressLater(headers, body)
    encoded_as(headers, coding)
    if coding == "gzip":
        return gzip.compress(body, _LEVEL, mtime=0)
    return zlib.compress(body, _LEVEL)  # HTTP's "deflate" is the zlib format


def encoded_as(headers: list[tuple[bytes, bytes]], coding: str) -> None:
    """The headers of an answer compressed with `coding`."""
    headers.append((b"content-encoding", coding.encode()))
    headers.append((b"vary", b"accept-encoding"))


def compress_pieces(pieces: list[bytes], coding: str) -> bytes:
    """The body `pieces` join into, compressed as `compress_response` compresses it (the
    same bytes once decompressed), without joining them first; for a thread: zlib lets
    go of the GIL while it compresses, and so does the join of what it made."""
    # gzip.compress(mtime=0) is zlib's gzip format (wbits 31); "deflate" is the zlib one.
    packer = zlib.compressobj(_LEVEL, zlib.DEFLATED, 31 if coding == "gzip" else 15)
    packed = [packer.compress(piece) for piece in pieces]
    packed.append(packer.flush())
    return b"".join(packed)
