"""uvicorn's httptools protocol, with the limits a public edge needs, sending each
response in one write.

Limits and deadlines (nginx's client_header_timeout, client_body_timeout,
large_client_header_buffers, keepalive_timeout and worker_connections, in one place):
a request head larger than `max_header_bytes` gets 431; a head not complete within
`header_timeout_s` of its first byte, or a body not complete within `body_timeout_s` of
its head, gets 408 and the connection is closed; a connection that sends nothing for
`keep_alive_timeout_s` (a new one included: uvicorn arms that timer only after a first
response) is closed; past `max_connections` open connections a new one is answered 503
(JSON, Retry-After) and closed at once, so its descriptor is free again and the
connections already open keep working. The head is counted as it arrives, before
httptools buffers it (it joins a header's pieces as they come: a 100 MB header would
cost 100 MB and quadratic copying).

This subclasses uvicorn's private HttpToolsProtocol, so pyproject.toml pins uvicorn's
minor version; a new uvicorn is taken by reading its httptools_impl.py against this.

uvicorn writes a response's head and its body with two `transport.write` calls: two
system calls and two TCP segments per response, and the client wakes twice to read them.
At thousands of small inference responses a second that is a measurable share of the
gateway's CPU. So a response head is held back and sent together with the write that
follows it (the body, or its first chunk); a head with nothing after it in the same
event-loop step goes out at the end of that step. Nothing else about the protocol changes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


class _HeadWithBody:
    """A transport that sends a response head together with the write after it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if self._pending:  # the body after a held head: both go now, in one send
            self._pending.append(data)
            self._flush()
        elif data.startswith(b"HTTP/1.") and data.endswith(b"\r\n\r\n"):
            self._pending.append(data)
            self._loop.call_soon(self._flush)  # in case nothing follows in this step
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()  # what was written before close still goes out, as with a transport
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may take; see the module docstring and the README."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 2048


def error_message(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole response, written straight to the socket: the gateway's JSON error."""
    body = orjson.dumps({"error": message})
    head = [
        STATUS_LINE[status],
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n",
    ]
    if retry_after_s is not None:
        head.append(b"retry-after: %d\r\n" % retry_after_s)
    return b"".join([*head, b"\r\n", body])


# The raw head is the parsed one plus its framing (method, version, line ends): a few
# dozen bytes. The raw count only has to stop a head that never ends.
_FRAMING_SLACK = 256


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the answer is already chosen."""


class GatewayHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    # Head and body in one write; False only to measure its gain (benchmarks/http_protocol.py).
    one_write: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn types it as int; it is only ever given to loop.call_later.
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._in_head = False
        self._head_bytes = 0  # as received: bounds what httptools buffers
        self._header_bytes = 0  # as parsed (line and headers): the limit itself
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: bytes | None = None

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GatewayHttpProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.one_write:
            transport = _HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[assignment]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._answer_and_close(
                error_message(
                    503,
                    f"the gateway has {self.limits.max_connections} connections open, its "
                    "limit; retry shortly. Hint: reuse connections (keep-alive), or raise "
                    "max_connections in the profile's [server] table",
                    1,
                )
            )
            return
        # uvicorn arms the idle timer only after a response: a connection that never
        # sends a byte would stay open (and hold a descriptor) for ever.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._clear_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None or self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if self._refusal is None:
                self._refusal = error_message(400, f"malformed HTTP request: {exc}")
            self._answer_and_close(self._refusal)
            return
        if self._in_head:  # still in the head after all of this data: count it all
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes + _FRAMING_SLACK:
                self._answer_and_close(self._too_large_head())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = self._header_bytes = 0
        self._set_deadline(self.limits.header_timeout_s, "the request head (line and headers)")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._set_deadline(self.limits.body_timeout_s, "the request body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._clear_deadline()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:  # JSON, as every other error
        self._answer_and_close(error_message(400, f"malformed HTTP request: {msg}"))

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            self._refusal = self._too_large_head()
            raise _Refused

    def _too_large_head(self) -> bytes:
        return error_message(
            431,
            f"the request head is over {self.limits.max_header_bytes} bytes, the limit. "
            "Hint: send large values in the body, or raise max_header_kb in the profile's "
            "[server] table",
        )

    def _set_deadline(self, seconds: float, what: str) -> None:
        self._clear_deadline()
        self._deadline = self.loop.call_later(seconds, self._too_slow, seconds, what)

    def _clear_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self, seconds: float, what: str) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not self._in_head and cycle.response_started:
            self.transport.close()  # an answer is on its way; it cannot be replaced
            return
        self._answer_and_close(
            error_message(
                408,
                f"{what} did not arrive within {seconds:g} s; the connection is closed. "
                "Hint: send requests whole and promptly",
            )
        )

    def _answer_and_close(self, response: bytes) -> None:
        self._clear_deadline()
        self._unset_keepalive_if_required()
        if self.cycle is not None and not self.cycle.response_complete:
            # The app, if it is waiting for the body, sees the client go: its own answer
            # would have nowhere to go.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()
