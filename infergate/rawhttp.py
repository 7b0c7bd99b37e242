"""A minimal HTTP/1.1 keep-alive client over asyncio streams, for load generation.

Why not httpx: at the request rates a benchmark drives on two cores, httpx's per-request
cost (hundreds of microseconds) would measure the client, not the server. This does the
one thing a load generator needs: POST a prepared body, read a Content-Length response.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


class RawConnection:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._host = host

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or 80
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    def request_bytes(
        self, method: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> bytes:
        """The whole request, prepared once and sent many times."""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self._host}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def send(self, prepared: bytes) -> RawResponse:
        self._writer.write(prepared)
        head = await self._reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers = {}
        for line in header_lines:
            if line:
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await self._reader.readexactly(length) if length else b""
        return RawResponse(status, headers, body)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()
