"""Bounds on how a request body arrives, beside its size (max_request_mb): what its
chunked framing may cost, and how much of a body answered before it ended is read.

A body's cost is not only its bytes. Each piece of a chunked body is a parser callback in
Python, and uvicorn joins the pieces into one bytes object (a copy of all so far per
piece): a body sent one byte a chunk held every tenant's requests at 779 ms p50. Chunk
extensions (`1;aaaa...`) are parsed in C but never reach the body: one connection sending
an endless extension was read at 580 MB/s for 60 s (until its body deadline), every
tenant's requests at 51-63 ms p50, and it did the same after its request was refused (a
401 before the body), since the rest of a refused body was read to its end to keep the
connection. So:

- past `FREE_PIECES` pieces (chunks, or reads of a body with a Content-Length), a body
  must average `MIN_PIECE_BYTES` a piece (curl, requests and tritonclient send kilobytes a
  chunk; a pretty-printed JSON document streamed a line a chunk passes);
- the bytes read while a body arrives may exceed its data by a quarter, and
  `FRAMING_ALLOWANCE` (the read it begins in aside, `READ_CREDIT`): chunk extensions cost a
  request at most about 320 KB (they were read at 760 MB/s as 3 MB a request, reconnecting
  after each 400, another tenant at 7.9 ms p50);
- a request answered before its body ended (401, 403, 404, 429...) reads at most
  `DRAIN_AT_MOST` more of it to keep the connection; with more to come, or a chunked body
  of unknown length, the connection ends after the answer (a lingering close, so the
  answer is not lost);
- a connection that takes no more requests (lingering, or past its pipeline) drops what
  its client still sends, up to `DROP_AT_MOST`, then closes: a client that sends that much
  after its answer is not reading it (one that kept sending after its 400 was read, and
  dropped, at 2 GB/s until the idle timeout: another tenant's p50 4 ms instead of 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope

FREE_PIECES = 1024
MIN_PIECE_BYTES = 64
FRAMING_ALLOWANCE = 64 * 1024
# The read a body begins in is not counted (up to this, the event loop's largest read):
# what comes before the body in it (its head, requests pipelined before it) is not framing.
READ_CREDIT = 256 * 1024
DRAIN_AT_MOST = 64 * 1024
DROP_AT_MOST = 1 << 20


def too_many_pieces(pieces: int, data: int) -> str:
    return (
        f"the request body came in {pieces} pieces for {data} bytes; past {FREE_PIECES} "
        f"pieces a body must average at least {MIN_PIECE_BYTES} bytes a piece. Hint: send "
        "the body in larger writes or chunks"
    )


def framing_too_large(raw: int, data: int) -> str:
    return (
        f"the request body's framing is far larger than its data ({raw} bytes read for "
        f"{data} bytes of body): chunk extensions or padding. Hint: send the body with a "
        "Content-Length, or chunks without extensions"
    )


def rest_is_large(headers: list[tuple[bytes, bytes]], received: int) -> bool:
    """Whether what is left of a body answered early is more than worth reading to keep
    its connection: over DRAIN_AT_MOST by its Content-Length, or of unknown length."""
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value) - received > DRAIN_AT_MOST
            except ValueError:
                return True
    return True  # chunked: no length to go by


def refused_app(message: str) -> ASGI3Application:
    """An ASGI app answering a 400 with `message`: a pipelined request refused for its
    framing, answered in its turn, after the answers owed before it."""
    body = orjson.dumps({"error": message})

    async def refused(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 400, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return refused
