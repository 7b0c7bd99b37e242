"""Compressed responses, when the client's Accept-Encoding asks for gzip or deflate (as
tritonclient's `response_compression_algorithm` does) and the body is worth it."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable

_LEVEL = 1  # fast: the point is fewer bytes on a slow link, not the smallest body
# Smaller bodies go as they are (as nginx's gzip_min_length): compressing them saves
# almost nothing, and httpx, curl --compressed and browsers ask for gzip on every request.
MIN_BYTES = 1024


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


def compress_response(
    request_headers: Iterable[tuple[bytes, bytes]],
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    status: int,
) -> bytes:
    """The body to send, compressed (and Content-Encoding added) when the client asked.
    Errors go as they are: tritonclient.http.aio reads them before it decompresses."""
    if status != 200 or len(body) < MIN_BYTES:  # first: most answers stop here
        return body
    coding = None
    for key, value in request_headers:  # ASGI header names are lower case
        if key == b"accept-encoding":
            coding = _chosen(value.decode("latin-1"))
            break
    if coding is None:
        return body
    headers.append((b"content-encoding", coding.encode()))
    headers.append((b"vary", b"accept-encoding"))
    if coding == "gzip":
        return gzip.compress(body, _LEVEL, mtime=0)
    return zlib.compress(body, _LEVEL)  # HTTP's "deflate" is the zlib format
