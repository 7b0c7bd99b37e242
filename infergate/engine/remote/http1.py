"""A small HTTP/1.1 client for the pass-through: one pool of keep-alive connections per
endpoint, with a cap on connections. httpx costs about 1 ms more per request than this on
a small machine (measured: p50 1.9-2.2 ms against 0.6-1.0 ms, sequential calls to the
same upstream), and the pass-through's overhead is the product. The control calls
(metadata, readiness, health checks) go through a pool of their own too: through httpx,
each one an endless answer cut short left its 4 MB in reference cycles (anyio's stream
and transport) that only the gateway's rare full collections freed.

Errors say what can be retried: ConnectFailed (the connection never opened, nothing was
sent), PoolTimeout (no connection came free in time, nothing was sent), BrokenReply
(the request may have reached the upstream).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from infergate.engine.remote.slots import FairSlots, Turn
from infergate.errors import BrokenReply, ConnectFailed, PoolTimeout, StaleConnection

# A request body as the gateway holds it: a large one is a view of its mapping, written
# to the socket as it is (copied to bytes, 60 MB held the event loop for 30-40 ms).
Payload = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


class Sender(Protocol):
    """What the remote pool sends requests through (tests pass fakes)."""

    async def request(
        self,
        path: str,
        headers: dict[str, str],
        body: Payload,
        connect_timeout_s: float,
        pool_timeout_s: float,
        turn: Turn = (0, None),
    ) -> Reply: ...

    async def close(self) -> None: ...


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def usable(self) -> bool:
        # An idle connection the server closed has seen EOF by now (as httpcore checks);
        # one with bytes waiting holds what no request asked for (more than an answer's
        # length said): the next request would read them as its answer.
        # (StreamReader keeps what it read ahead in `_buffer`: asyncio has no public view.)
        reader = self.reader
        waiting = getattr(reader, "_buffer", b"")
        return not (self.writer.is_closing() or reader.at_eof() or waiting)

    def close(self) -> None:
        self.writer.close()


_MAX_HEAD = 64 * 1024
TOO_LARGE_HINT = (
    " (max_answer_mb). Hint: raise [remote] max_answer_mb in model.toml if the model's "
    "outputs are that large"
)


class Http1Pool:
    def __init__(
        self,
        base_url: str,
        max_connections: int,
        max_keepalive: int,
        max_answer_bytes: int = 256 << 20,
        too_large_hint: str = TOO_LARGE_HINT,
    ) -> None:
        self._max_answer = max_answer_bytes
        self._too_large_hint = too_large_hint
        parts = urlsplit(base_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc
        self._slots = FairSlots(max_connections)  # by class, then tenants in turn
        self._max_keepalive = max_keepalive
        self._idle: list[_Connection] = []
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self, timeout_s: float) -> _Connection:
        if self._https and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port, ssl=self._ssl, limit=_MAX_HEAD),
                timeout_s,
            )
        except TimeoutError:
            raise ConnectFailed(f"no connection within {timeout_s:.3g} s") from None
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from None
        return _Connection(reader, writer)

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable():
                return connection
            connection.close()
        return None

    async def request(
        self,
        path: str,
        headers: dict[str, str],
        body: Payload,
        connect_timeout_s: float,
        pool_timeout_s: float,
        turn: Turn = (0, None),
        method: str = "POST",
    ) -> Reply:
        """POST `body` to `path` (or GET it, without a body), once a connection is free and
        it is `turn`'s turn (class rank, tenant). A caller that gives up (cancels) closes
        the connection."""
        try:
            await asyncio.wait_for(self._slots.acquire(turn), pool_timeout_s)
        except TimeoutError:
            raise PoolTimeout(f"no connection came free within {pool_timeout_s:.3g} s") from None
        connection: _Connection | None = None
        try:
            connection = self._take_idle()
            reused = connection is not None
            try:
                if connection is None:
                    connection = await self._connect(connect_timeout_s)
                reply, keep = await self._exchange(connection, method, path, headers, body)
            except StaleConnection as exc:
                if not reused:  # a new connection: the upstream took the request, and ended
                    raise BrokenReply(
                        f"the upstream closed the connection unanswered ({exc})"
                    ) from None
                # The server closed it while it sat idle (the race every keep-alive client
                # has): nothing was answered, so the same request goes on a new connection.
                assert connection is not None
                connection.close()
                connection = await self._connect(connect_timeout_s)
                reply, keep = await self._exchange(connection, method, path, headers, body)
            if keep and len(self._idle) < self._max_keepalive:
                self._idle.append(connection)
            else:
                connection.close()
            connection = None
            return reply
        finally:
            if connection is not None:  # failed or cancelled mid-exchange: not reusable
                connection.close()
            self._slots.release()

    async def _exchange(
        self,
        connection: _Connection,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Payload,
    ) -> tuple[Reply, bool]:
        lines = [
            f"{method} {self._prefix}{path} HTTP/1.1",
            f"Host: {self._host_header}",
            *([f"Content-Length: {len(body)}"] if method == "POST" else []),
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        reader = connection.reader
        answered = False
        try:
            connection.writer.writelines((head, body))
            await connection.writer.drain()
            try:
                raw = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise StaleConnection("the connection closed before any answer") from None
                raise
            answered = True
            # Interim answers (100 Continue, 103 Early Hints) come before the answer: taken
            # as it, the answer itself stayed unread for the connection's next request.
            while raw[9:10] == b"1" and raw[9:12] != b"101":
                raw = await reader.readuntil(b"\r\n\r\n")
            return await read_reply(raw, reader, self._max_answer, self._too_large_hint)
        except (ConnectionResetError, BrokenPipeError) as exc:
            if not answered:
                raise StaleConnection(f"{type(exc).__name__}: {exc}") from None
            raise BrokenReply(f"{type(exc).__name__}: {exc}") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            # (OSError: ssl.SSLError and the rest besides ConnectionError, not a 500)
            raise BrokenReply(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # one loop turn: closed transports finish closing


async def read_reply(
    raw: bytes, reader: asyncio.StreamReader, max_body: int, hint: str = TOO_LARGE_HINT
) -> tuple[Reply, bool]:
    """The reply whose head is `raw`, its body read from `reader`: at most `max_body`
    bytes of it (BrokenReply past that, with `hint`, before it is read: it would be held
    whole)."""
    status_line, *header_lines = raw[:-4].decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    try:
        status = int(rest[:3])
    except ValueError:
        raise BrokenReply(f"not an HTTP status line: {status_line[:80]!r}") from None
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader, max_body, hint)
    elif "content-length" in headers:
        declared = headers["content-length"]
        if not (declared.isascii() and declared.isdigit() and len(declared) < 19):
            raise BrokenReply(f"bad Content-Length {declared[:40]!r}")
        length = int(declared)
        if length > max_body:
            raise _too_large(max_body, f"its Content-Length is {length}", hint)
        body = await reader.readexactly(length)
    elif status in (204, 304) or 100 <= status < 200:
        body = b""
    else:  # delimited by the end of the connection: read to it, within the limit
        parts: list[bytes] = []
        total = 0
        while chunk := await reader.read(1 << 16):
            total += len(chunk)
            if total > max_body:
                raise _too_large(max_body, "it went on past that", hint)
            parts.append(chunk)
        body, keep = b"".join(parts), False
    return Reply(status, headers, body), keep


def _too_large(limit: int, why: str, hint: str) -> BrokenReply:
    return BrokenReply(f"the answer is larger than the {limit >> 20} MB allowed ({why}){hint}")


async def _read_chunked(reader: asyncio.StreamReader, max_body: int, hint: str) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        digits = size_line.split(b";", 1)[0].strip()
        try:
            size = int(digits, 16)
        except ValueError:
            size = -1
        if size < 0 or not digits.isalnum() or len(digits) > 16:
            raise BrokenReply(f"bad chunk size {size_line[:40]!r}")
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return b"".join(parts)
        total += size
        if total > max_body:
            raise _too_large(max_body, f"its chunks pass {max_body} bytes", hint)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
