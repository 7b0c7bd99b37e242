"""What one connection may take (issue 12): a head over the size limit gets 431, heads and
bodies that come too slowly get 408 and the connection closed, silent connections are
closed, and past the connection cap a newcomer is answered 503 at once while the open
connections keep working. The limits here are small so the tests wait little; each
test polls the socket and never sleeps for a limit."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.edge_raw import closed_by_server, connect, head, read_reply
from tests.onnx_models import make_mlp
from tests.polling import wait_until
from tests.server import ServerProcess

TIGHT = """
[server]
max_header_kb = 4
header_timeout_s = 0.5
body_timeout_s = 0.5
keep_alive_timeout_s = 0.5
"""
CAPPED = """
[server]
max_connections = 3
keep_alive_timeout_s = 60
header_timeout_s = 60
"""


def _server(folder: Path, profile_text: str) -> ServerProcess:
    models = folder / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    profile = folder / "profile.toml"
    profile.write_text(profile_text)
    return ServerProcess(models, profile, folder / "server.log")


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = _server(tmp_path_factory.mktemp("tight"), TIGHT).start()
    yield proc
    proc.stop()


def test_an_oversized_head_gets_431(tight: ServerProcess) -> None:
    with connect(tight.port) as sock:
        sock.sendall(head("GET", "/v2/health/live", tight.port, {"X-Big": "a" * 16_000}))
        reply = read_reply(sock)
    assert reply is not None
    assert reply.status == 431
    assert "over 4096 bytes" in str(reply.json()["error"])


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100-continue"])
def test_a_body_with_an_upgrade_and_connect_are_refused_in_words(
    tight: ServerProcess, expect: bool
) -> None:
    """httptools reads no body after an Upgrade head: `curl --http2` on http:// (Upgrade:
    h2c) got "the body has 0 bytes but Content-Length says 13", after a 100 Continue that
    invited the body. CONNECT got "malformed HTTP request: User callback error"."""
    body = b'{"inputs":[]}'
    headers = {
        "Connection": "Upgrade, HTTP2-Settings",
        "Upgrade": "h2c",
        "HTTP2-Settings": "AAMAAABkAAQAoAAAAAIAAAAA",
        "Content-Length": str(len(body)),
    }
    if expect:
        headers["Expect"] = "100-continue"
    with connect(tight.port) as sock:
        sock.sendall(head("POST", "/v2/models/mlp/infer", tight.port, headers))
        reply = read_reply(sock)
        assert reply is not None
        assert (reply.status, reply.headers["connection"]) == (400, "close")  # no 100 first
        assert str(reply.json()["error"]).startswith(
            "a request with an Upgrade header cannot carry a body here: "
        )
    with connect(tight.port) as sock:
        sock.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        reply = read_reply(sock)
        assert reply is not None
        assert reply.status == 400
        assert str(reply.json()["error"]).startswith("CONNECT is not served: ")


def test_a_100_mb_header_is_cut_off_quickly(tight: ServerProcess) -> None:
    """The gateway stops reading after a few kilobytes: the sender runs into a closed
    connection long before its 100 MB are out."""
    chunk = b"a" * 2**20
    sent = 0
    started = time.monotonic()
    with connect(tight.port) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            while sent < 100 * 2**20 and time.monotonic() - started < 60:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    elapsed = time.monotonic() - started
    assert sent < 32 * 2**20, f"the gateway took {sent / 2**20:.0f} MB of header"
    assert elapsed < 5


def _trickle_until_closed(sock: socket.socket, first: bytes, limit_s: float) -> float:
    """Send `first`, then a byte every 0.1 s (a slowloris) until the server closes."""
    started = time.monotonic()
    sock.sendall(first)
    while time.monotonic() - started < limit_s:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            break
        try:
            sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            break
    closed, _ = closed_by_server(sock, 1)
    assert closed
    return time.monotonic() - started


def test_a_slow_head_is_cut_after_header_timeout(tight: ServerProcess) -> None:
    with connect(tight.port) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        reply = read_reply(sock, timeout_s=15)  # the head never completes
    assert reply is not None
    assert reply.status == 408
    assert "request head" in str(reply.json()["error"])
    with connect(tight.port) as sock:  # trickling bytes does not keep it open
        took = _trickle_until_closed(sock, b"GET /v2/health/live HTTP/1.1\r\nX-Slow: ", 15)
    assert took < 5


def test_a_slow_body_is_cut_after_body_timeout(tight: ServerProcess) -> None:
    with connect(tight.port) as sock:
        headers = {"Content-Length": "1000", "Content-Type": "application/json"}
        sock.sendall(head("POST", "/v2/models/mlp/infer", tight.port, headers) + b'{"inp')
        started = time.monotonic()
        reply = read_reply(sock, timeout_s=15)
        took = time.monotonic() - started
    assert reply is not None
    assert reply.status == 408
    assert "request body" in str(reply.json()["error"])
    assert took < 5
    with connect(tight.port) as sock:
        headers = {"Content-Length": "100000"}
        took = _trickle_until_closed(
            sock, head("POST", "/v2/models/mlp/infer", tight.port, headers), 15
        )
    assert took < 5


def test_idle_connections_are_closed(tight: ServerProcess) -> None:
    with connect(tight.port) as sock:  # a new connection that never says anything
        closed, took = closed_by_server(sock, 15)
    assert closed
    assert took < 5
    with connect(tight.port) as sock:  # and one idle after a request
        sock.sendall(head("GET", "/v2/health/live", tight.port))
        reply = read_reply(sock)
        assert reply is not None
        assert reply.status == 200
        closed, took = closed_by_server(sock, 15)
    assert closed
    assert took < 5


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = _server(tmp_path, CAPPED).start()
    yield proc
    proc.stop()


def test_past_the_connection_cap_a_newcomer_gets_503_and_the_others_keep_working(
    capped: ServerProcess,
) -> None:
    held = [connect(capped.port) for _ in range(3)]
    try:
        for sock in held:  # each one busy with a request it has not finished sending
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        with connect(capped.port) as newcomer:
            started = time.monotonic()
            reply = read_reply(newcomer, timeout_s=15)
            took = time.monotonic() - started
        assert reply is not None
        assert reply.status == 503
        assert reply.headers["retry-after"] == "1"
        assert "3 connections open" in str(reply.json()["error"])
        assert took < 5
        for sock in held:  # the connections already open are served
            sock.sendall(f"Host: 127.0.0.1:{capped.port}\r\n\r\n".encode())
            answer = read_reply(sock)
            assert answer is not None
            assert answer.status == 200
    finally:
        for sock in held:
            sock.close()
    wait_until(partial(_served, capped.port), 15, "their slots back as they close")


def test_the_connection_cap_leaves_descriptors_for_the_gateway() -> None:
    """Where the open-file limit cannot hold max_connections plus the gateway's own
    descriptors, the cap is lowered (and says so) rather than letting clients take them
    all; where it can be raised, it is."""
    script = (
        "import resource, logging\n"
        "from infergate.cli.serve import connection_cap\n"
        "logging.basicConfig(level='WARNING', format='%(message)s')\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 600))\n"
        "print(connection_cap(100), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "print(connection_cap(2048), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["100", "356", "344", "600"]
    assert "max_connections = 2048 does not fit the open-file limit (600); using 344" in (
        done.stderr
    )


def _served(port: int) -> bool:
    """Whether a new connection's request is answered 200 (not refused at the cap)."""
    with connect(port) as sock:
        sock.sendall(head("GET", "/v2/health/live", port))
        reply = read_reply(sock)
    return reply is not None and reply.status == 200


def _connect_from(address: str, port: int) -> socket.socket:
    """A connection from another loopback address: another client, as the gateway sees it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    return sock


@pytest.mark.parametrize("fronts", [0, 1], ids=["one-process", "fronts"])
def test_one_client_past_its_connection_cap_leaves_room_for_others(
    tmp_path: Path, fronts: int
) -> None:
    """`max_connections_per_client`: a client holding connections open with heads it never
    finishes (no key checked yet) gets 503 for one more, while another client's connection
    is served; a slot it closes is its own again."""
    profile = (
        f"[server]\nmax_connections_per_client = 2\nheader_timeout_s = 60\nfronts = {fronts}\n"
    )
    server = _server(tmp_path, profile).start()
    held = [connect(server.port) for _ in range(2)]
    try:
        for sock in held:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        with connect(server.port) as third:
            reply = read_reply(third, timeout_s=15)
        assert reply is not None
        assert reply.status == 503
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"] == (
            "this client address has 2 connections open, the gateway's limit for one "
            "client; retry shortly. Hint: reuse connections (keep-alive), or raise "
            "max_connections_per_client in the profile's [server] table"
        )
        with _connect_from("127.0.0.2", server.port) as other:
            other.sendall(head("GET", "/v2/health/live", server.port))
            answer = read_reply(other)
        assert answer is not None
        assert answer.status == 200
        held.pop().close()
        wait_until(partial(_served, server.port), 15, "the closed connection's slot back")
        held.pop().close()
        # An upgrade (WebSocket) is answered as any other request, its Upgrade ignored, and
        # its connection closes: uvicorn switched it to WebSocket (a 403 from one process,
        # a 500 and an ERROR line from fronts), and it was never counted off its client:
        # three upgrades locked this address out for good.
        upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
        for _ in range(3):
            with connect(server.port) as upgrading:
                upgrading.sendall(head("GET", "/v2/health/live", server.port, upgrade))
                reply = read_reply(upgrading)
                assert reply is not None
                assert (reply.status, reply.headers.get("connection")) == (200, "close")
                assert closed_by_server(upgrading, 15)[0]
        wait_until(partial(_served, server.port), 15, "the slots back after three upgrades")
        assert "upgrade" not in server.log.read_text().lower()  # no warning, no error line
    finally:
        for sock in held:
            sock.close()
        server.stop()
