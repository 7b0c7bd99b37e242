"""An infer request's answer as the HTTP side sends it (`Reply`), made by the infer
route (server/infer_route.py) and written by the lane, a front or the ASGI route; and the
answers to errors that need no route: an error's headers, and the 500 for a bug."""

from __future__ import annotations

from typing import NamedTuple

from infergate.server.decoding import KEPT_NOTHING, Keeper
from infergate.server.errors import error_body, retry_after_header
from infergate.server.predecode import PackedOutputs

_JSON = (b"content-type", b"application/json")


class Reply(NamedTuple):
    """An infer request's answer, ready to send."""

    status: int
    headers: list[tuple[bytes, bytes]]  # Content-Length included
    body: bytes
    tenant: str  # the authenticated tenant's name, "-" before authentication
    keeper: Keeper  # what the request holds until its answer is sent
    # A 200 whose answer a front encodes (it decoded the request): its outputs, and no
    # body or headers here.
    outputs: PackedOutputs | None = None


_INTERNAL_BODY = error_body("internal error: the gateway could not answer this request")


def internal_error() -> Reply:
    """The answer to a bug outside the route's own error handling: a 500, after which
    the connection closes (as uvicorn's cycle does for an exception in the app)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(_INTERNAL_BODY)),
        (b"connection", b"close"),
    ]
    return Reply(500, headers, _INTERNAL_BODY, "-", KEPT_NOTHING)


def error_headers(retry_after_s: float | None) -> list[tuple[bytes, bytes]]:
    headers = [_JSON]
    if retry_after_s is not None:
        headers.append((b"retry-after", retry_after_header(retry_after_s).encode()))
    return headers
