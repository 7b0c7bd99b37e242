"""The channel between a front process and the engine (`[server] fronts`): messages as
marshal'd tuples, length-prefixed, over a Unix socket.

Every message sent in one event-loop step goes out as one frame (a list) at the end of the
step, so the hop is paid per burst, not per request: at the tiny model's c=64 load that is
about 2.4 µs of CPU per request on the sending side and 1.5 µs on the receiving one
(`benchmarks/front_hop.py --coalesce`), against 13-14 µs with one write per message.
marshal (not pickle) because both ends run the same interpreter from the same checkout,
and only they can reach the socket (its folder is the engine's, mode 0700).
"""

from __future__ import annotations

import asyncio
import marshal
import struct
from collections.abc import Callable
from typing import Any, cast

_LENGTH = struct.Struct("<Q")
Message = tuple[Any, ...]


class LinkProtocol(asyncio.Protocol):
    """One end of a link: each message received goes to `on_message`, in order."""

    def __init__(
        self, on_message: Callable[[Message], None], on_lost: Callable[[], None] | None = None
    ) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._buf = bytearray()
        self._pending: list[Message] = []
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self._on_lost is not None:
            self._on_lost()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if not buf and len(data) >= _LENGTH.size:  # the usual case: whole frames, nothing held
            (size,) = _LENGTH.unpack_from(data)
            if len(data) == _LENGTH.size + size:
                self._deliver(marshal.loads(memoryview(data)[_LENGTH.size :]))
                return
        buf += data
        pos = 0
        frames = []
        while len(buf) - pos >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf, pos)
            end = pos + _LENGTH.size + size
            if len(buf) < end:
                break
            frames.append(marshal.loads(memoryview(buf)[pos + _LENGTH.size : end]))
            pos = end
        del buf[:pos]
        for frame in frames:
            self._deliver(frame)

    def _deliver(self, frame: list[Message]) -> None:
        for message in frame:
            self._on_message(message)

    def send(self, message: Message) -> None:
        """Queue `message`; the step's messages go out together when it ends. Dropped when
        the link is down (its requests are failed by `on_lost`)."""
        if self.transport is None:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(message)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if self.transport is not None and pending:
            body = marshal.dumps(pending)
            self.transport.write(_LENGTH.pack(len(body)) + body)
