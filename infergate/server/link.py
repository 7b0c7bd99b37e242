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
import logging
import marshal
import struct
from collections.abc import Callable
from typing import Any, cast

log = logging.getLogger("infergate.server")

_LENGTH = struct.Struct("<Q")
# Queued messages carrying this many bytes of bodies go out as a frame at once.
FRAME_BYTES = 1 << 20
# The write buffer past which the peer is taken to fall behind (asyncio's default, 64 KiB,
# is crossed now and then by a burst of small requests' frames, and each crossing would
# hold a front's clients for nothing).
WRITE_HIGH_WATER = 4 << 20
Message = tuple[Any, ...]


class LinkProtocol(asyncio.Protocol):
    """One end of a link: each message received goes to `on_message`, in order."""

    def __init__(
        self,
        on_message: Callable[[Message], None],
        on_lost: Callable[[], None] | None = None,
        instead: Callable[[Message], Message | None] | None = None,
        on_writable: Callable[[bool], None] | None = None,
    ) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        # What to send in place of a message marshal cannot carry (None: nothing).
        self._instead = instead
        # Told False when the peer falls behind (the write buffer past its high-water
        # mark), True when it has caught up: a front holds its clients' reading meanwhile.
        self._on_writable = on_writable
        self._buf = bytearray()
        self._pending: list[Message] = []
        self._pending_bytes = 0  # the large bytes among them, as their senders said
        self.transport: asyncio.Transport | None = None
        self._writable: asyncio.Event | None = None  # set while the peer keeps up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.resume_writing()  # nobody waits on a link that is gone
        if self._on_lost is not None:
            self._on_lost()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.Event()
        self._writable.clear()
        if self._on_writable is not None:
            self._on_writable(False)

    def resume_writing(self) -> None:
        if self._writable is not None:
            self._writable.set()
        if self._on_writable is not None:
            self._on_writable(True)

    async def drained(self) -> None:
        """Return once the peer has read what this end wrote (the transport's buffer is
        below its high-water mark): what sends bodies awaits it, so that a slow or
        stopped peer holds up their senders (the client's socket, the app) instead of
        this end's memory."""
        if self._writable is not None and not self._writable.is_set():
            await self._writable.wait()

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

    def send(self, message: Message, size: int = 0) -> None:
        """Queue `message`; the step's messages go out together when it ends, or at once
        once those queued carry `FRAME_BYTES` (`size`: the bytes `message` carries, for
        one that carries a body), so that a frame, which the peer holds whole before it
        reads any of it, stays small. Dropped when the link is down (its requests are
        failed by `on_lost`)."""
        if self.transport is None:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(message)
        if size:
            self._pending_bytes += size
            if self._pending_bytes >= FRAME_BYTES:
                self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        if self.transport is not None and pending:
            try:
                body = marshal.dumps(pending)
            except ValueError:  # one it cannot carry (bytes of 2 GiB or more): the others go
                self._flush_apart(pending)
                return
            self.transport.write(_LENGTH.pack(len(body)) + body)

    def _flush_apart(self, pending: list[Message]) -> None:
        """A step's messages one frame each, the ones marshal cannot carry replaced by what
        `instead` says (an error answer to their request), or logged and dropped."""
        assert self.transport is not None
        for message in pending:
            try:
                body = marshal.dumps([message])
            except ValueError as exc:
                replaced = self._instead(message) if self._instead is not None else None
                log.error("the link could not carry a %r message (%s)", message[0], exc)
                if replaced is None:
                    continue
                body = marshal.dumps([replaced])
            self.transport.write(_LENGTH.pack(len(body)) + body)
