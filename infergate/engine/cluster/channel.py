"""The request path's connections to Redis: one awaited round trip per request.

Two things keep a shared limit cheap (benchmarks/redis_limits.py):

- A lease's release is written to a connection without waiting for its reply, which is
  read with the next call on that connection (Redis answers a connection's commands in
  order). It is written before the request's answer goes out, so a client's next request,
  to this replica or another, finds the slot free; nothing waits for Redis to confirm it.
- redis-py's client layer is skipped: per call it takes a pool lock, checks that the
  connection has nothing to read (which a pending release's reply would fail) and, with a
  socket timeout, runs each write in a task of its own (asyncio.wait_for before Python
  3.12), which is one more turn of the event loop. Here connections have no socket timeout
  of their own: the caller bounds the whole call (SharedLimits._call), and a call cut off
  there leaves its connection closed by redis-py, never half read.

redis-py still does what a library should: the URL (TLS, password, database), connecting,
packing commands and parsing replies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.asyncio import ConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError


class _Link:
    """A connection and how far its replies have been read: `sent` commands were written,
    `read` replies taken off it, in the same order. `ready` once its handshake is done."""

    __slots__ = ("conn", "read", "ready", "sent")

    def __init__(self, conn: AbstractConnection) -> None:
        self.conn = conn
        self.sent = 0
        self.read = 0
        self.ready = False

    @property
    def open(self) -> bool:
        return self.ready and self.conn.is_connected


class Channel:
    def __init__(
        self,
        url: str,
        connect_timeout_s: float,
        on_unread_error: Callable[[ResponseError], None] = lambda exc: None,
    ) -> None:
        # The pool only makes connections as the URL says; it never hands them out.
        self._pool = ConnectionPool.from_url(
            url, socket_timeout=None, socket_connect_timeout=connect_timeout_s
        )
        self._packer = self._connection()
        self._idle: list[_Link] = []  # the most recently used last: the next to be taken
        self._busy: list[_Link] = []  # waiting for a reply
        self._on_unread_error = on_unread_error  # an error reply to a command sent by `send`

    def _connection(self) -> AbstractConnection:
        conn: AbstractConnection = self._pool.make_connection()  # type: ignore[no-untyped-call]
        return conn

    def pack(self, *args: str | int | bytes) -> list[bytes]:
        packed: list[bytes] = self._packer.pack_command(*args)
        return packed

    async def call(self, command: list[bytes]) -> Any:
        """Send one command and return its reply (an error reply raises), first reading the
        replies to commands sent earlier on the same connection without waiting."""
        link = self._idle.pop() if self._idle else _Link(self._connection())
        self._busy.append(link)
        try:
            if not link.open:
                link.ready, link.sent, link.read = False, 0, 0
                await link.conn.connect()  # type: ignore[no-untyped-call]  # redis-py's
                link.ready = True
            link.sent += 1  # written now, before any other command can be
            mine = link.sent
            await link.conn.send_packed_command(command, check_health=False)
            while True:
                try:
                    reply = await link.conn.read_response()
                except ResponseError as exc:
                    reply = exc
                link.read += 1
                if link.read == mine:
                    break
                if isinstance(reply, ResponseError):
                    self._on_unread_error(reply)
        finally:
            self._busy.remove(link)
            if link.open:
                self._idle.append(link)
            elif link.conn.is_connected:  # its handshake was cut off
                await link.conn.disconnect(nowait=True)
            # else redis-py closed it: a write or read was cut off
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def send(self, command: list[bytes]) -> bool:
        """Write a command whose reply no one waits for, on the connection the next call
        takes (or one waiting for a reply now). False when no connection is open: Redis
        is not reachable, and the command is not sent."""
        for link in (*reversed(self._idle), *self._busy):
            if link.open:
                link.sent += 1
                # Writes at once; it waits only when the socket's buffer is full, which
                # the caller's bound cuts short (the connection is then closed).
                await link.conn.send_packed_command(command, check_health=False)
                return True
        return False

    async def close(self) -> None:
        """Close every connection; commands already written are still delivered."""
        links, self._idle, self._busy = [*self._idle, *self._busy], [], []
        for link in links:
            await link.conn.disconnect()
        await self._pool.disconnect()
