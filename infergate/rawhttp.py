"""A minimal HTTP/1.1 keep-alive client on an asyncio Protocol, for load generation.

Why not httpx: at the request rates a benchmark drives on two cores, httpx's per-request
cost (hundreds of microseconds) would measure the client, not the server. Why not asyncio
streams: a StreamReader costs two awaits and a copy per response. This does the one thing
a load generator needs: POST a prepared body, wait for one Content-Length response.

What a server sends is bounded (AnswerLimits): a head of at most 64 KiB, a body of at most
its cap by its Content-Length (refused unread past it), and of that body only its first
bytes kept when the caller says so (a load generator needs an error's start, not a
tensor). A connection holds at most about one head's worth of bytes no request awaits.
An answer past a limit is a RawResponse whose `refused` says which (a load generator counts
it as it counts the others), and its connection is closed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import urlsplit

from infergate.client_codec import MAX_DOCUMENT_BYTES

MAX_HEAD_BYTES = 64 << 10  # an answer's status line and headers; infergate's are < 1 KiB
# A body is kept whole by default, up to MAX_DOCUMENT_BYTES (a document: statistics,
# metadata); a load generator passes the inference cap and keeps only a prefix.
_CONTENT_LENGTH_DIGITS = 18  # more is no length any server means
_NO_SUCH_LENGTH = 10**_CONTENT_LENGTH_DIGITS  # what a longer one reads as: past any cap


@dataclass(frozen=True)
class AnswerLimits:
    head_bytes: int = MAX_HEAD_BYTES
    body_bytes: int = MAX_DOCUMENT_BYTES  # by Content-Length: a larger body is refused
    kept_bytes: int | None = None  # of a body, the first bytes kept (None: all of it)


RefusedPart = Literal["head", "body", "unasked"]


@dataclass(frozen=True)
class Refusal:
    """Why an answer was not read: its `part` went past a limit (the head, the body's
    Content-Length, or bytes no request asked for); `message` says so in one line."""

    part: RefusedPart
    message: str


@dataclass(frozen=True)
class RawResponse:
    status: int  # 0 when refused
    head: bytes  # the status line and headers, as sent
    body: bytes  # the body, or its first AnswerLimits.kept_bytes
    # The body's Content-Length; None when the answer gives none (a chunked or
    # close-delimited body, which is not read: the connection cannot be used again).
    length: int | None = None
    # An answer past the limits: not read, and its connection closed (each later send on
    # it answers the same).
    refused: Refusal | None = None


@dataclass
class _Body:
    """An answer whose head is read and whose body is still coming."""

    status: int
    head: bytes
    length: int
    left: int  # bytes of the body still to come
    kept: bytearray


class _Responses(asyncio.Protocol):
    """Reads the awaited response (head + Content-Length body) as it comes, within limits."""

    def __init__(self, limits: AnswerLimits) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[RawResponse] | None = None
        self._limits = limits
        self._buffer = bytearray()  # bytes not read yet: a head in the making
        self._searched = 0  # of the buffer, the bytes known to hold no head's end
        self._body: _Body | None = None
        self._lost: Exception | None = None
        self._refused: RawResponse | None = None  # the answer to every request, once refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's transports are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._lost is not None or self._refused is not None:
            return  # the connection is closing: nothing more is read
        self._buffer += data
        try:
            if self._body is not None:
                self._read_body(self._body)
            else:
                self._read_answer()
        except ValueError as exc:  # an answer that is not HTTP
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is None:
            self._lost = exc or ConnectionResetError("the server closed the connection")
        self._answer_later()

    def expect(self) -> asyncio.Future[RawResponse]:
        self.waiter = asyncio.get_running_loop().create_future()
        self._answer_later()
        return self.waiter

    def _answer_later(self) -> None:
        """The awaited request's answer on a connection that is done: its refusal (which
        says why better than the close it caused), else the error that ended it."""
        if self.waiter is None or self.waiter.done():
            return
        if self._refused is not None:
            self.waiter.set_result(self._refused)
        elif self._lost is not None:
            self.waiter.set_exception(self._lost)

    def _read_answer(self) -> None:
        """The awaited answer's head, and its body if it is all here (the common case: one
        copy); else the body is read as it comes. Bytes no request awaits are not read."""
        waiter = self.waiter
        if waiter is None or waiter.done():
            self._check_unasked()
            return
        buffer, limits = self._buffer, self._limits
        # (from where the last look stopped: a head that comes a byte at a time is not
        # searched again from its start for each byte)
        end = buffer.find(b"\r\n\r\n", max(0, self._searched - 3), limits.head_bytes + 4)
        if end < 0:
            self._searched = len(buffer)
            if len(buffer) > limits.head_bytes + 3:
                self._refuse(
                    "head",
                    f"unread answer: its head went past {_size(limits.head_bytes)} without "
                    "ending (a status line and headers take far less)",
                )
            return
        self._searched = 0
        head = bytes(buffer[:end])
        status, length = _parse_head(head)
        if length is not None and length > limits.body_bytes:
            self._refuse("body", _too_long(status, length, limits.body_bytes))
            return
        start = end + 4
        if length is None or len(buffer) - start >= length:
            size = length or 0
            kept = size if limits.kept_bytes is None else min(size, limits.kept_bytes)
            body = bytes(buffer[start : start + kept])
            del buffer[: start + size]
            waiter.set_result(RawResponse(status, head, body, length))
            if buffer:  # bytes no request asked for, yet
                self._check_unasked()
            return
        del buffer[:start]
        self._body = _Body(status, head, length, length, bytearray())
        self._read_body(self._body)

    def _read_body(self, body: _Body) -> None:
        """More of a body that came in pieces: its start kept, the rest counted."""
        taken = min(body.left, len(self._buffer))
        kept = self._limits.kept_bytes
        keep = taken if kept is None else min(taken, max(0, kept - len(body.kept)))
        if keep:
            body.kept += self._buffer[:keep]
        del self._buffer[:taken]
        body.left -= taken
        if body.left:
            return
        self._body = None
        if self.waiter is not None and not self.waiter.done():  # (else: the run ended)
            self.waiter.set_result(
                RawResponse(body.status, body.head, bytes(body.kept), body.length)
            )
        self._check_unasked()

    def _check_unasked(self) -> None:
        """Bytes no request awaits yet are at most a head's worth: a server that sends
        more (before a request, or after an answer) would grow the buffer without end."""
        if len(self._buffer) > self._limits.head_bytes + 4:
            self._refuse(
                "unasked",
                f"unread answer: the server sent more than {_size(self._limits.head_bytes)} "
                "that no request asked for",
            )

    def _refuse(self, part: RefusedPart, message: str) -> None:
        """Answer the awaited request (and any later one on this connection) with a
        refusal, and close the connection at once: what it still sends is not read."""
        self._refused = RawResponse(0, b"", b"", None, Refusal(part, message))
        self._close_now()

    def _fail(self, exc: ValueError) -> None:
        """Fail the awaited request (and any later one) with `exc`: an answer that is not
        HTTP leaves nothing on this connection to read."""
        self._lost = exc
        self._close_now()

    def _close_now(self) -> None:
        self._buffer.clear()
        self._searched = 0
        self._body = None
        self._answer_later()
        if self.transport is not None:
            self.transport.abort()


def _size(limit: int) -> str:
    return f"{limit / 2**20:g} MB" if limit >= 1 << 20 else f"{limit / 2**10:g} KB"


_CONTENT_LENGTH = b"\r\ncontent-length:"


def _parse_head(head: bytes) -> tuple[int, int | None]:
    """The status and Content-Length (None: no length, a chunked or close-delimited body)
    of a response head; ValueError for a head that is not HTTP/1.x. A length too long to
    mean anything reads as _NO_SUCH_LENGTH. (On the load generator's path: a few finds, no
    line split.)"""
    status = head[9:12]
    if not head.startswith(b"HTTP/1.") or not status.isdigit():
        line = head.split(b"\r\n", 1)[0]
        raise ValueError(f"not an HTTP/1.1 status line: {line[:60]!r}")
    lower = head.lower()
    marker = lower.find(_CONTENT_LENGTH)
    if marker < 0 or b"\r\ntransfer-encoding:" in lower:  # (it overrides a length)
        return int(status), None
    start = marker + len(_CONTENT_LENGTH)
    stop = lower.find(b"\r\n", start)
    value = head[start:stop].strip() if stop >= 0 else head[start:].strip()
    if stop >= 0 and lower.find(_CONTENT_LENGTH, stop) >= 0:  # (rare: all must agree)
        _one_length(head, lower)
    if not value.isdigit():
        raise ValueError(f"a Content-Length that is not a number: {value[:30]!r}")
    if len(value) > _CONTENT_LENGTH_DIGITS:  # (and int() of thousands of digits is slow)
        return int(status), _NO_SUCH_LENGTH
    return int(status), int(value)


def _too_long(status: int, length: int, limit: int) -> str:
    said = "at least 10^18" if length == _NO_SUCH_LENGTH else str(length)
    return (
        f"unread answer: HTTP {status} with a Content-Length of {said} bytes, more than the "
        f"{_size(limit)} read of an answer"
    )


def _one_length(head: bytes, lower: bytes) -> None:
    """ValueError unless the head's Content-Length headers all say the same: two lengths
    leave the body's end to whoever reads it (a request smuggled past one of them)."""
    values = set()
    start = lower.find(_CONTENT_LENGTH)
    while start >= 0:
        start += len(_CONTENT_LENGTH)
        stop = lower.find(b"\r\n", start)
        stop = len(head) if stop < 0 else stop
        values.add(head[start:stop].strip())
        start = lower.find(_CONTENT_LENGTH, stop)
    if len(values) > 1:
        raise ValueError(f"two Content-Length values: {sorted(values)!r}")


class RawConnection:
    def __init__(self, transport: asyncio.Transport, protocol: _Responses, host: str) -> None:
        self._transport = transport
        self._protocol = protocol
        self._host = host

    @classmethod
    async def open(cls, url: str, limits: AnswerLimits | None = None) -> RawConnection:
        """A connection to `url`'s host; its answers are read within `limits` (by default
        a document's: the head and a body of MAX_DOCUMENT_BYTES, kept whole)."""
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or 80
        protocol_limits = limits or AnswerLimits()
        transport, protocol = await asyncio.get_running_loop().create_connection(
            lambda: _Responses(protocol_limits), host, port
        )
        return cls(transport, protocol, f"{host}:{port}")

    def request_bytes(
        self, method: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> bytes:
        """The whole request, prepared once and sent many times."""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self._host}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def send(self, prepared: bytes) -> RawResponse:
        """Send a prepared request and wait for its response (`refused` when it is past
        the limits); OSError if the connection is gone, ValueError for an answer that is
        not HTTP/1.x. After either, or a refusal, the connection is closed."""
        waiter = self._protocol.expect()
        self._transport.write(prepared)
        return await waiter

    async def close(self) -> None:
        self._transport.close()
