"""A response's head and body in one write (`GatewayHttpProtocol.one_write`).

uvicorn writes a response's head and its body in two calls to the transport, so a small
answer costs two sends and wakes its client twice; this transport holds the head back
until the write after it (or the end of the loop's step) and sends both at once. A lone
client's p50 is about 20 µs lower for it (benchmarks/http_protocol.py, README
"Performance")."""

from __future__ import annotations

import asyncio
from typing import Any

# A body longer than this is written after its head, not joined to it: the join copies the
# body on the event loop (about 100 ms for 160 MB), while one more send costs microseconds.
JOIN_AT_MOST = 64 * 1024


class HeadWithBody:
    """A transport that sends a response head together with the write after it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        # Bound once: uvicorn asks these on every request, and __getattr__ costs more.
        self.is_closing = transport.is_closing
        self.get_extra_info = transport.get_extra_info

    def write(self, data: bytes) -> None:
        if self._pending:  # the body after a held head: both go now, in one send
            if len(data) > JOIN_AT_MOST:
                self._flush()
                self._transport.write(data)
                return
            self._pending.append(data)
            self._flush()
        elif data.endswith(b"\r\n\r\n") and data.startswith(b"HTTP/1."):  # (a body: one test)
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

    def write_eof(self) -> None:
        self._flush()  # the same: the held head goes before the FIN
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
