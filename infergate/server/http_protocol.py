"""uvicorn's httptools protocol, sending each response in one write.

uvicorn writes a response's head and its body with two `transport.write` calls: two
system calls and two TCP segments per response, and the client wakes twice to read them.
At thousands of small inference responses a second that is a measurable share of the
gateway's CPU. So a response head is held back and sent together with the write that
follows it (the body, or its first chunk); a head with nothing after it in the same
event-loop step goes out at the end of that step. Nothing else about the protocol changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


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


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        wrapped = _HeadWithBody(transport, asyncio.get_running_loop())
        super().connection_made(wrapped)  # type: ignore[arg-type]
