"""Loopback servers that write what they like, when they like, for the tests of clients
against a hostile server (the CLI, bench, top): a thread per connection, and what each
connection gets is the test's. `RawServer` answers one request a connection (an answer
may drip, or never end); bench's tests keep connections alive with a server of their own
on the same `LoopbackServer`. Also the hostile text those tests send, and the check that
none of it reaches a terminal raw."""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterator

# What a terminal acts on: C0 controls but tab and newline (TSV's and every line's), DEL
# and C1. None may reach stdout or stderr from a server.
RAW_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# A window title, a cleared screen, a CR that overwrites the line, CSI in its 8-bit form.
HOSTILE = "sad \x1b]0;PWNED\x07\x1b[2J\rFAKE: all good \x9b31m\x7f\x00 end"
HOSTILE_ESCAPED = "sad \\x1b]0;PWNED\\x07\\x1b[2J\\rFAKE: all good \\x9b31m\\x7f\\x00 end"


def assert_inert(text: str) -> None:
    found = RAW_CONTROLS.findall(text)
    assert not found, f"raw control characters {found} in {text!r}"


class LoopbackServer:
    """A loopback port whose connections `serve` (a subclass's) each get in a thread of
    their own. At close `stop` is set and every connection is shut down, which wakes an
    accept or a recv."""

    def __init__(self, scheme: str = "http") -> None:
        self.stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"{scheme}://127.0.0.1:{self._listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def close(self) -> None:
        """The listener's fd is closed only once its accept thread has returned: closed
        under a thread blocked in accept(), the fd's number went to the next test's
        listener, and this server (its `stop` set) answered that one's connections. Seen
        under py-spy: a POST answered by the server before, a drip answer cut short."""
        self.stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (EINVAL)
        self._acceptor.join(timeout=10)
        assert not self._acceptor.is_alive(), "the accept thread did not stop"
        self._listener.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


Answer = Callable[[socket.socket, str, threading.Event], None]


class RawServer(LoopbackServer):
    """HTTP whose `answer(conn, request_line, stop)` writes what it likes once the
    request's head is read, one request a connection. An answer that drips waits on
    `stop` between two writes. `tls`: HTTPS with it."""

    def __init__(self, answer: Answer, tls: ssl.SSLContext | None = None) -> None:
        self._answer = answer
        self._tls = tls
        super().__init__("https" if tls else "http")

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):  # (a client gone: its own business)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
        with conn, contextlib.suppress(OSError):
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            request = head.partition(b"\r\n\r\n")[0].decode("latin-1")  # (a body may follow)
            self._answer(conn, " ".join(request.split()[:2]), self.stop)


@contextlib.contextmanager
def raw_server(answer: Answer, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    server = RawServer(answer, tls)
    try:
        yield server.url
    finally:
        server.close()
