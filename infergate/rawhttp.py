"""A minimal HTTP/1.1 keep-alive client on an asyncio Protocol, for load generation.

Why not httpx: at the request rates a benchmark drives on two cores, httpx's per-request
cost (hundreds of microseconds) would measure the client, not the server. Why not asyncio
streams: a StreamReader costs two awaits and a copy per response. This does the one thing
a load generator needs: POST a prepared body, wait for one Content-Length response.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RawResponse:
    status: int
    head: bytes  # the status line and headers, as sent
    body: bytes


class _Responses(asyncio.Protocol):
    """Collects bytes until the awaited response (head + Content-Length body) is whole."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[RawResponse] | None = None
        self._buffer = bytearray()
        self._lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's transports are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionResetError("the server closed the connection")
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self._lost)

    def expect(self) -> asyncio.Future[RawResponse]:
        self.waiter = asyncio.get_running_loop().create_future()
        if self._lost is not None:
            self.waiter.set_exception(self._lost)
        return self.waiter

    def _complete(self) -> None:
        if self.waiter is None or self.waiter.done():
            return
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self._buffer[:end])
        marker = head.lower().find(b"\r\ncontent-length:")
        length = 0
        if marker >= 0:
            start = marker + len(b"\r\ncontent-length:")
            stop = head.find(b"\r\n", start)
            length = int(head[start : stop if stop >= 0 else len(head)])
        total = end + 4 + length
        if len(self._buffer) < total:
            return
        body = bytes(self._buffer[end + 4 : total])
        del self._buffer[:total]
        status = int(head[9:12])  # "HTTP/1.1 200 ..."
        self.waiter.set_result(RawResponse(status, head, body))


class RawConnection:
    def __init__(self, transport: asyncio.Transport, protocol: _Responses, host: str) -> None:
        self._transport = transport
        self._protocol = protocol
        self._host = host

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or 80
        transport, protocol = await asyncio.get_running_loop().create_connection(
            _Responses, host, port
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
        """Send a prepared request and wait for its response; OSError if the connection
        is gone."""
        waiter = self._protocol.expect()
        self._transport.write(prepared)
        return await waiter

    async def close(self) -> None:
        self._transport.close()
