"""What a request body's framing may cost (server/body_framing.py): chunk extensions and
one-byte chunks are bounded whether the request is served or refused, and a request
refused before its body ends is not read to its end. One connection sending an endless
chunk extension was read at 580 MB/s for 60 s, every tenant's requests at 51-63 ms p50;
one-byte chunks held them at 779 ms."""

from __future__ import annotations

import contextlib
import select
import socket

import httpx
import pytest

from infergate.server.body_framing import FRAMING_ALLOWANCE, FREE_PIECES
from tests.edge_raw import closed_by_server, connect, head, read_reply
from tests.server import ServerProcess

CHUNKED = {"Transfer-Encoding": "chunked", "Content-Type": "application/json"}


def _send_all_we_can(sock: socket.socket, data: bytes) -> None:
    """Send `data`; a server that ended the connection meanwhile is what some tests want."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)


def _ended(sock: socket.socket) -> bool:
    """Whether the server has ended the connection (its end read, nothing else left)."""
    ready, _, _ = select.select([sock], [], [], 0.01)
    return bool(ready) and sock.recv(65536) == b""


@pytest.mark.parametrize("key", ["bogus-key", None], ids=["refused-401", "served"])
def test_an_endless_chunk_extension_ends_the_connection(
    server: ServerProcess, key: str | None
) -> None:
    """Refused (an unknown key: 401 before the body) or not, a body whose chunk extension
    never ends is not read on for the body's 60 s: the refused one's connection ends after
    its 401, the served one gets a 400 that says why once its framing passes the allowance."""
    headers = dict(CHUNKED)
    if key is not None:
        headers["X-API-Key"] = key
    with connect(server.port) as sock:
        sock.sendall(head("POST", "/v2/models/mlp/infer", server.port, headers) + b"1;")
        # Past the allowance, and not more: all of it is read by the time the server stops.
        _send_all_we_can(sock, b"a" * (FRAMING_ALLOWANCE + 65536))
        reply = read_reply(sock, timeout_s=20)
        assert reply is not None
        if key is not None:
            assert reply.status == 401
        else:
            assert reply.status == 400
            assert "framing is far larger than its data" in str(reply.json()["error"])
        closed, _ = closed_by_server(sock, timeout_s=10)
    assert closed


def test_one_byte_chunks_are_refused_after_a_few(server: ServerProcess) -> None:
    pieces = FREE_PIECES * 2
    with connect(server.port) as sock:
        body = b"1\r\n \r\n" * pieces + b"0\r\n\r\n"
        sock.sendall(head("POST", "/v2/models/mlp/infer", server.port, CHUNKED) + body)
        reply = read_reply(sock, timeout_s=20)
    assert reply is not None
    assert reply.status == 400
    assert f"came in {FREE_PIECES + 1} pieces for {FREE_PIECES + 1} bytes" in str(reply.json())


def test_a_chunked_body_in_reasonable_chunks_is_served(server: ServerProcess) -> None:
    body = b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
    chunks = [body[i : i + 8] for i in range(0, len(body), 8)]  # 10 small chunks: fine
    answer = httpx.post(
        f"{server.url}/v2/models/mlp/infer", content=iter(chunks), headers=CHUNKED, timeout=20
    )
    assert answer.status_code == 200, answer.text


def test_a_large_upload_refused_before_its_body_is_not_read_to_its_end(
    server: ServerProcess,
) -> None:
    """A 401 before a 900 KB body: the connection ends after the answer (a lingering
    close), where it used to read all of it to keep the connection. A small body refused
    so is still read, and its connection kept."""
    with connect(server.port) as sock:
        # Within the shared server's 1 MB limit (a larger one is refused as too large),
        # past what is read to keep a connection.
        sized = {"Content-Length": str(900_000), "X-API-Key": "bogus-key"}
        sock.sendall(head("POST", "/v2/models/mlp/infer", server.port, sized))
        reply = read_reply(sock, timeout_s=20)
        assert reply is not None
        assert reply.status == 401
        sent = 0
        while sent < 900_000 and not _ended(sock):  # the body, a kilobyte at a time
            sock.sendall(b" " * 1024)
            sent += 1024
        assert sent < 100_000, "the server read the refused body on, to keep the connection"
    with connect(server.port) as sock:
        small = b"{}" * 100
        sized = {"Content-Length": str(len(small)), "X-API-Key": "bogus-key"}
        sock.sendall(head("POST", "/v2/models/mlp/infer", server.port, sized) + small)
        small_reply = read_reply(sock, timeout_s=20)
        assert small_reply is not None
        assert small_reply.status == 401
        sock.sendall(head("GET", "/v2/health/live", server.port))
        again = read_reply(sock, timeout_s=20)
        assert again is not None
        assert again.status == 200  # the same connection, kept
