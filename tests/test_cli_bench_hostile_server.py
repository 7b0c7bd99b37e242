"""`infergate bench` (its load generator, infergate/loadgen.py, and raw HTTP client,
infergate/rawhttp.py) against a server that means harm: a head without end, a body
declared larger than any answer bench reads, bytes no request asked for, a chunked body
that also declares a length, a statistics endpoint that stops answering mid-run. Each is
a failed request of its level with one line saying why, read within bounds (never the
gigabytes a server sends), and the run ends on time: never a hang or a traceback.

The server: LoadServer here (on tests/raw_servers.py's LoopbackServer), HTTP/1.1 with
keep-alive on a loopback port, whose handlers write what they like, as long as they like."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from infergate import loadgen
from infergate.loadgen import Plan, Target, run_level
from infergate.rawhttp import RawConnection, Refusal
from infergate.server_split import server_split_reader
from tests.fake_servers import ANSWER, METADATA, run
from tests.polling import eventually
from tests.raw_servers import LoopbackServer

# Writes an answer on the connection; returns whether the connection serves another.
Handler = Callable[[socket.socket, threading.Event], bool]
MB = 1 << 20
# How much a server "without end" sends at most: far past every cap, so that a client
# that reads it all fails the test, yet bounded, so that one run before the fix cannot
# take the machine's memory.
ENDLESS_BYTES = 16 * MB


def reply(conn: socket.socket, body: bytes, status: str = "200 OK", extra: bytes = b"") -> bool:
    conn.sendall(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s"
                 % (status.encode(), len(body), extra, body))  # fmt: skip
    return True


def hold(conn: socket.socket, stop: threading.Event) -> bool:
    """Send nothing more until the client hangs up (or the server closes)."""
    with contextlib.suppress(OSError):
        while not stop.is_set() and conn.recv(65536):
            pass
    return False


def send_for_long(conn: socket.socket, stop: threading.Event, start: bytes, piece: bytes) -> None:
    """`start`, then `piece` again and again up to ENDLESS_BYTES (a client that hangs up
    ends it), then nothing more until the client hangs up."""
    with contextlib.suppress(OSError):
        conn.sendall(start)
        sent = len(start)
        while sent < ENDLESS_BYTES and not stop.is_set():
            conn.sendall(piece)
            sent += len(piece)
    hold(conn, stop)


class LoadServer(LoopbackServer):
    """HTTP/1.1 with keep-alive: each request (its head and Content-Length body read) goes
    to the handler of its "METHOD /path" (404 without one); `requests` counts them by that
    key."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.requests: dict[str, int] = {}
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # (a client gone: its own business)
            pending = b""
            while not self.stop.is_set():
                line, pending = _read_request(conn, pending)
                if not line:
                    return
                self.requests[line] = self.requests.get(line, 0) + 1
                handler = self.handlers.get(line)
                if handler is None:
                    reply(conn, b'{"error": "no such path"}', "404 Not Found")
                elif not handler(conn, self.stop):
                    return


def _read_request(conn: socket.socket, pending: bytes) -> tuple[str, bytes]:
    """The next request's "METHOD /path" ("" when the client is gone) and what came after
    its body."""
    while b"\r\n\r\n" not in pending:
        chunk = conn.recv(65536)
        if not chunk:
            return "", b""
        pending += chunk
    head, _, rest = pending.partition(b"\r\n\r\n")
    length = 0
    for header in head.split(b"\r\n")[1:]:
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return "", b""
        rest += chunk
    return " ".join(head.decode().split()[:2]), rest[length:]


def model_server(infer: Handler, **more: Handler) -> LoadServer:
    """Model `m` (tests/fake_servers.py's METADATA), whose inferences `infer` answers."""
    metadata = json.dumps(METADATA).encode()
    handlers: dict[str, Handler] = {
        "GET /v2/models/m": lambda conn, _: reply(conn, metadata),
        "POST /v2/models/m/infer": infer,
        **more,
    }
    return LoadServer(handlers)


@contextlib.contextmanager
def serving(infer: Handler, **more: Handler) -> Iterator[LoadServer]:
    server = model_server(infer, **more)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def short_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level waits DRAIN_S (5 s) for the requests still out: short here, where a failing
    run (before the fixes) would wait it out."""
    monkeypatch.setattr(loadgen, "DRAIN_S", 0.3)


def bench(url: str, *flags: str) -> tuple[int, dict[str, Any]]:
    """One level of one short window; its exit code and its level's JSON."""
    r = run("bench", "m", "--duration", "0.2", "--windows", "1", "--json", "--url", url, *flags)
    [level] = json.loads(r.stdout)["levels"]
    assert r.stderr == "", r.stderr  # no traceback, no stray line
    return r.code, level


def only_failure(level: dict[str, Any]) -> dict[str, Any]:
    assert level["ok"] == 0, level
    failures: list[dict[str, Any]] = level["failures"]
    [failure] = failures
    assert (failure["kind"], failure["status"]) == ("no_answer", None), failure
    assert failure["count"] == level["failed"] > 0, level
    return failure


# --- what bench reads of an answer: bounded ------------------------------------------


def test_a_head_without_end_is_refused_past_64_kb(short_drain: None) -> None:
    """bench kept every byte of a head until its blank line: a server that never sent one
    grew it for as long as the run lasted."""

    def endless_head(conn: socket.socket, stop: threading.Event) -> bool:
        send_for_long(conn, stop, b"HTTP/1.1 200 OK\r\nx-pad: ", b"a" * 65536)
        return False

    with serving(endless_head) as server:
        code, level = bench(server.url)
    assert code == 1
    assert only_failure(level)["error"] == (
        "unread answer: its head went past 64 KB without ending (a status line and headers "
        "take far less). Hint: is --url an infergate server?"
    )


def test_a_body_declared_past_the_cap_is_refused_unread(short_drain: None) -> None:
    """A Content-Length of a terabyte was read as it came (and kept), for as long as the
    server sent it; past the inference cap (256 MB, as `infer` reads) it is refused at
    once, and `--max-answer-mb` moves the cap as `infer`'s does."""

    def terabyte(conn: socket.socket, stop: threading.Event) -> bool:
        send_for_long(conn, stop, b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % 10**12,
                      b" " * 65536)  # fmt: skip
        return False

    with serving(terabyte) as server:
        code, level = bench(server.url)
    assert code == 1
    assert only_failure(level)["error"] == (
        "unread answer: HTTP 200 with a Content-Length of 1000000000000 bytes, more than the "
        "256 MB read of an answer. Hint: if the model's outputs are that large, raise "
        "bench's --max-answer-mb"
    )

    two_mb = b"x" * (2 * MB)
    with serving(lambda conn, _: reply(conn, two_mb)) as server:
        code, level = bench(server.url, "--max-answer-mb", "1")
        assert code == 1
        assert only_failure(level)["error"].startswith(
            f"unread answer: HTTP 200 with a Content-Length of {2 * MB} bytes, more than the "
            "1 MB read of an answer."
        )
        code, level = bench(server.url, "--max-answer-mb", "3")
        assert (code, level["failed"]) == (0, 0), level
        assert level["ok"] > 0


def test_an_error_page_past_its_start_still_says_its_error(short_drain: None) -> None:
    """Of a body bench keeps only its start (an error's text is there): a 2 MB error page
    is its title, as a small one is."""
    page = b"<html><head><title>503 Busy</title></head><body>" + b"x" * (2 * MB) + b"</body>"

    def busy(conn: socket.socket, _: threading.Event) -> bool:
        return reply(conn, page, "503 Service Unavailable", b"content-type: text/html\r\n")

    with serving(busy) as server:
        code, level = bench(server.url)
    assert code == 1
    [failure] = level["failures"]
    assert (failure["kind"], failure["status"]) == ("http", 503)
    assert failure["error"] == "an HTML page: 503 Busy"


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n"
     b"2\r\n{}\r\n0\r\n\r\n", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"],
    ids=["chunked-with-a-length", "chunked-without-end"],
)  # fmt: skip
def test_a_chunked_answer_is_never_read_as_a_success(short_drain: None, answer: bytes) -> None:
    """bench does not read chunked bodies. One that also gave a Content-Length was read by
    it (a success, and the rest of its chunks misread as the next answer); one without
    end is not read past its head: its connection is closed."""

    def chunked(conn: socket.socket, stop: threading.Event) -> bool:
        send_for_long(conn, stop, answer, b"10000\r\n" + b" " * 65536 + b"\r\n")
        return False

    with serving(chunked) as server:
        code, level = bench(server.url)
    assert code == 1
    assert only_failure(level)["error"] == (
        "unreadable answer (HTTP 200 without a Content-Length: a chunked or close-delimited "
        "body, which bench does not read)"
    )


async def test_bytes_no_request_asked_for_close_the_connection() -> None:
    """A connection with no request out kept whatever the server sent: an answer followed
    by megabytes more grew it while it waited for its next request."""
    hung_up = threading.Event()

    def answer_then_flood(conn: socket.socket, stop: threading.Event) -> bool:
        reply(conn, b"{}")
        send_for_long(conn, stop, b"", b"z" * 65536)
        hung_up.set()  # the client closed the connection (or the test ended)
        return False

    server = LoadServer({"POST /x": answer_then_flood})
    try:
        conn = await RawConnection.open(server.url)
        prepared = conn.request_bytes("POST", "/x", b"")
        assert (await conn.send(prepared)).body == b"{}"
        await eventually(hung_up.is_set, what="the client to close the flooded connection")
        refused = Refusal(
            "unasked", "unread answer: the server sent more than 64 KB that no request asked for"
        )
        assert (await conn.send(prepared)).refused == refused  # and the same for the next
        assert (await conn.send(prepared)).refused == refused
        await conn.close()
    finally:
        server.close()


# --- a server that stops answering: the run ends on time -------------------------------

ONE_MS = {"ns": 10**6, "count": 1}
STATS = json.dumps(
    {"model_stats": [{"inference_stats": {"queue": ONE_MS, "compute_infer": ONE_MS}}]}
).encode()


async def test_a_statistics_endpoint_that_stops_answering_ends_with_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench reads the model's statistics at the edges of its windows (the server's
    split) and waited for each answer without a bound: a server that answered the first
    read and then no more held the run for ever. A read waits SPLIT_TIMEOUT_S at most,
    and the level goes on without its split."""
    monkeypatch.setattr(loadgen, "DRAIN_S", 0.3)
    monkeypatch.setattr(loadgen, "SPLIT_TIMEOUT_S", 0.3)
    reads = 0

    def stats_once(conn: socket.socket, stop: threading.Event) -> bool:
        nonlocal reads
        reads += 1
        return reply(conn, STATS) if reads == 1 else hold(conn, stop)

    answer = json.dumps(ANSWER).encode()
    handlers: dict[str, Handler] = {"GET /v2/models/m/stats": stats_once}
    with serving(lambda conn, _: reply(conn, answer), **handlers) as server:
        target = Target(server.url, "/v2/models/m/infer", b"{}", {}, model="m")
        plan = Plan(window_s=0.2, windows=3)
        started = time.monotonic()
        result = await asyncio.wait_for(
            run_level(target, "concurrency", 1, plan, server_split=server_split_reader(target)),
            20,  # a bound on a run that hangs (it did, before), not a delay
        )
        took = time.monotonic() - started
    assert result.ok > 0, result
    assert result.failed == 0, result
    assert result.server is None  # its last read never came
    assert reads == 2  # one read ran out; the windows after it did not wait again
    assert took < 3 * 0.2 + 0.3 + 5, took


async def test_an_answer_that_never_ends_is_cut_off_at_the_end_of_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body within the cap that comes without end (a byte now and then) is the request
    still out when the windows end: it waits DRAIN_S, then counts as unanswered."""
    monkeypatch.setattr(loadgen, "DRAIN_S", 0.3)

    def drip(conn: socket.socket, stop: threading.Event) -> bool:
        with contextlib.suppress(OSError):
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
            while not stop.wait(0.05):
                conn.sendall(b" ")
        return False

    with serving(drip) as server:
        target = Target(server.url, "/v2/models/m/infer", b"{}", {})
        result = await asyncio.wait_for(
            run_level(target, "concurrency", 2, Plan(window_s=0.2, windows=1)), 20
        )
    assert (result.ok, result.failed) == (0, 2), result
    [lost] = result.failures
    assert lost.error == "no answer by the end of the run (0.3 s after the last window)"


def test_a_statistics_answer_bench_cannot_read_leaves_the_split_out(short_drain: None) -> None:
    """A statistics answer that is not HTTP (or past the limits) ended the run with an
    error no command expected: the split is optional, so the level has none."""

    def garbage(conn: socket.socket, _: threading.Event) -> bool:
        conn.sendall(b"garbage\r\n\r\n")
        return False

    answer = json.dumps(ANSWER).encode()
    handlers: dict[str, Handler] = {"GET /v2/models/m/stats": garbage}
    with serving(lambda conn, _: reply(conn, answer), **handlers) as server:
        code, level = bench(server.url)
    assert code == 0, level
    assert level["ok"] > 0, level
    assert level["server"] is None
