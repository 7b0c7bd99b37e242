"""uvicorn's httptools protocol, sending each response in one write.

uvicorn writes a response's head and its body with two `transport.write` calls: two
system calls and two TCP segments per response, and the client wakes twice to read them.
At thousands of small inference responses a second that is a measurable share of the
gateway's CPU. Writes made within one event-loop step are joined and sent once, at the
end of that step; nothing else about the protocol changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _OneWritePerStep:
    """A transport whose writes within one loop step go out as one."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

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
        wrapped = _OneWritePerStep(transport, asyncio.get_running_loop())
        super().connection_made(wrapped)  # type: ignore[arg-type]
