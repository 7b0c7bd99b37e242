"""A raw HTTP/1.1 socket for the edge tests: they send what no well-behaved client
library would (a head without its body, a header a byte at a time, a 100 MB header)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict[str, object]:
        doc = orjson.loads(self.body)
        assert isinstance(doc, dict)
        return doc


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def head(method: str, path: str, port: int, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _cut(data: bytes) -> tuple[Reply, bytes] | None:
    """The first whole response in `data` and the bytes after it, or None if none is whole."""
    raw_head, found, rest = data.partition(b"\r\n\r\n")
    if not found:
        return None
    lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    length = int(headers.get("content-length", "0"))
    if len(rest) < length:
        return None
    return Reply(int(lines[0].split()[1]), headers, rest[:length]), rest[length:]


def read_replies(sock: socket.socket, count: int, timeout_s: float = 30.0) -> list[Reply]:
    """`count` responses (to pipelined requests: several may come in one read), or as many
    as came before the server closed the connection."""
    sock.settimeout(timeout_s)
    replies: list[Reply] = []
    data = b""
    while len(replies) < count:
        if (cut := _cut(data)) is not None:
            reply, data = cut
            replies.append(reply)
            continue
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return replies


def read_reply(sock: socket.socket, timeout_s: float = 30.0) -> Reply | None:
    """One response, or None when the server closed the connection without one."""
    replies = read_replies(sock, 1, timeout_s)
    return replies[0] if replies else None


def closed_by_server(sock: socket.socket, timeout_s: float) -> tuple[bool, float]:
    """Wait for the server to close (or answer and close); (closed, seconds waited)."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False, time.monotonic() - started
    except ConnectionResetError:
        pass
    return True, time.monotonic() - started


def big_json_body(mb: int = 60) -> tuple[bytes, dict[str, str]]:
    """`mb` MB of JSON numbers: one FP32 tensor of "0.5" elements (15 million in 60 MB)."""
    count = mb * 2**20 // 4  # "0.5," per element
    # The data written out, not dumped: a list of 15 million floats took 0.6 s to dump.
    tensor = {"name": "x", "datatype": "FP32", "shape": [count], "data": []}
    data = b'"data":[' + b"0.5," * (count - 1) + b"0.5]"
    body = orjson.dumps({"inputs": [tensor]}).replace(b'"data":[]', data)
    return body, {"Content-Type": "application/json"}
