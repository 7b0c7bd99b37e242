"""Responses leave the gateway in one write: head and body together, nothing lost on close;
a busy connection costs no timer per request; and a pipelining client is answered in
order, up to a bounded depth of requests waiting."""

from __future__ import annotations

import asyncio
import socket
from functools import partial
from typing import Any

import numpy as np
import pytest
from starlette.types import Receive, Scope, Send

from infergate.loadgen import prepare
from infergate.server.http_protocol import PIPELINE_DEPTH, ConnectionLimits, GatewayHttpProtocol
from infergate.server.one_write import HeadWithBody
from tests.fake_connection import serve_on
from tests.polling import eventually
from tests.server import ServerProcess

_OK_HEADERS = [(b"content-length", b"2")]


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_a_head_goes_out_with_its_body_and_close_flushes_first() -> None:
    async def scenario() -> list[list[bytes]]:
        transport = _Transport()
        wrapped = HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        seen = []
        wrapped.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        seen.append(list(transport.writes))  # the head waits for its body
        wrapped.write(b"body")
        seen.append(list(transport.writes))  # and goes with it at once
        wrapped.write(b"more body")  # not a head: straight through
        seen.append(list(transport.writes))
        wrapped.write(b"HTTP/1.1 204 No Content\r\n\r\n")  # a head alone...
        await asyncio.sleep(0)
        seen.append(list(transport.writes))  # ...goes at the end of the step
        wrapped.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
        wrapped.close()  # close sends what is held first
        await asyncio.sleep(0)  # the scheduled flush finds nothing left
        seen.append(list(transport.writes))
        assert transport.closed
        assert wrapped.get_extra_info("peername") == "info:peername"  # the rest is passed on
        return seen

    head = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n"
    no_content = b"HTTP/1.1 204 No Content\r\n\r\n"
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n"
    assert asyncio.run(scenario()) == [
        [],
        [head + b"body"],
        [head + b"body", b"more body"],
        [head + b"body", b"more body", no_content],
        [head + b"body", b"more body", no_content, closing],
    ]


def _request(server: ServerProcess, close: bool, value: float = 1.0) -> bytes:
    x = np.full((1, 4), value, dtype=np.float32)
    body, headers = prepare({"x": x}, binary=True)
    lines = [
        "POST /v2/models/mlp/versions/1/infer HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _responses(data: bytes) -> list[tuple[bytes, bytes]]:
    """Split a byte stream of Content-Length responses into (head, body) pairs."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        out.append((head, rest[:length]))
        data = rest[length:]
    return out


def _exchange(server: ServerProcess, payload: bytes) -> list[tuple[bytes, bytes]]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(payload)
        chunks = []
        while chunk := sock.recv(1 << 20):  # until the server closes the connection
            chunks.append(chunk)
    return _responses(b"".join(chunks))


def test_pipelined_requests_get_whole_responses_in_order(server: ServerProcess) -> None:
    values = [0.0, 1.0, 2.0, 3.0, 4.0]
    one_by_one = [_exchange(server, _request(server, close=True, value=v))[0] for v in values]
    requests = [_request(server, close=v == values[-1], value=v) for v in values]
    pipelined = _exchange(server, b"".join(requests))  # all at once: HTTP/1.1 pipelining
    assert [head.split(b"\r\n")[0] for head, _ in pipelined] == [b"HTTP/1.1 200 OK"] * 5
    assert [body for _, body in pipelined] == [body for _, body in one_by_one]
    assert len({body for _, body in pipelined}) == 5  # five inputs, five different answers


def test_connection_close_still_delivers_the_whole_response(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(_request(server, close=True))
        chunks = []
        while chunk := sock.recv(1 << 20):  # until the server closes
            chunks.append(chunk)
    data = b"".join(chunks)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"connection: close" in head.lower()
    assert b'"model_name":"mlp"' in body


class _Socketless(_Transport):
    """A transport with no socket behind it (uvicorn then leaves addresses out)."""

    def get_extra_info(self, name: str) -> None:  # type: ignore[override]
        return None


def _more_than(items: list[bytes], count: int) -> bool:
    return len(items) > count


def test_a_busy_keep_alive_connection_arms_no_timer_per_request() -> None:
    """The head, body and keep-alive deadlines share one lazily moved timer: arming and
    cancelling timers three times a request was a measurable share of the gateway's CPU.
    The deadlines still hold: a head stalled after the answers is cut at its own timeout,
    though the idle one armed before it is far later."""
    limits = ConnectionLimits(header_timeout_s=0.2, keep_alive_timeout_s=600.0)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": _OK_HEADERS})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> tuple[int, float, list[bytes]]:
        loop = asyncio.get_running_loop()
        armed = 0
        call_at, call_later = loop.call_at, loop.call_later

        def counting_at(when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            nonlocal armed
            armed += getattr(callback, "__self__", None) is protocol  # not the test's sleeps
            return call_at(when, callback, *args)

        def counting_later(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            return counting_at(loop.time() + delay, callback, *args)

        transport = _Socketless()
        protocol = serve_on(transport, app, limits)
        setattr(loop, "call_at", counting_at)  # noqa: B010  (mypy: a method replaced)
        setattr(loop, "call_later", counting_later)  # noqa: B010
        began = loop.time()
        try:
            for i in range(20):
                protocol.data_received(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
                await eventually(partial(_more_than, transport.writes, i), what=f"answer {i}")
            counted, took = armed, loop.time() - began
            protocol.data_received(b"GET /x HTTP/1.1\r\nHost: a\r\n")  # the head stalls
            await eventually(lambda: transport.closed, what="the stalled head cut")
        finally:
            setattr(loop, "call_at", call_at)  # noqa: B010
            setattr(loop, "call_later", call_later)  # noqa: B010
            protocol.connection_lost(None)
        return counted, took, transport.writes

    armed, took, writes = asyncio.run(scenario())
    assert len(writes) == 21
    assert all(w.endswith(b"\r\n\r\nok") for w in writes[:20])
    # One timer, and a move forward at most, plus one more each time the shared timer
    # came due while the answers went on (a slow machine); the old code armed 60.
    assert armed <= 2 + int(took / limits.header_timeout_s)
    assert writes[20].startswith(b"HTTP/1.1 408")


def test_a_long_pipeline_is_answered_up_to_its_depth_then_closed_cleanly(
    server: ServerProcess,
) -> None:
    """9,000 small requests in one write (369 KB): they used to be parsed and queued all at
    once (a read ending inside a head was also refused 431, counting the whole read as that
    head). Now the requests taken are answered, in order, the last with Connection: close,
    and the connection ends with a FIN after them, not a reset that could lose them."""
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request * 9000)
        chunks = []
        while chunk := sock.recv(1 << 20):  # a reset raises ConnectionResetError
            chunks.append(chunk)
    replies = _responses(b"".join(chunks))
    assert PIPELINE_DEPTH + 1 <= len(replies) < 9000
    assert {head.split(b"\r\n")[0] for head, _ in replies} == {b"HTTP/1.1 200 OK"}
    closing = [b"connection: close" in head.lower() for head, _ in replies]
    assert closing == [False] * (len(replies) - 1) + [True]


class _Pipe(_Socketless):
    """A socketless transport that a pipelining client writes to: it can be paused and
    half-closed, as a TCP transport can."""

    def __init__(self) -> None:
        super().__init__()
        self.eof = False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        assert not self.closed, "half-closed after close"
        self.eof = True

    def write(self, data: bytes) -> None:
        assert not self.eof, "written after the FIN"
        super().write(data)


def _get(path: str, pad: int = 0) -> bytes:
    padding = b"X-Pad: %s\r\n" % (b"p" * pad) if pad else b""
    return b"GET %s HTTP/1.1\r\nHost: a\r\n%s\r\n" % (path.encode(), padding)


def _connection(
    limits: ConnectionLimits, gate: asyncio.Event | None = None
) -> tuple[GatewayHttpProtocol, _Pipe]:
    """The protocol on a `_Pipe`, in this event loop, with an app that answers each
    request its path (once `gate` is open)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        if gate is not None:
            await gate.wait()
        body = scope["path"].encode()
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    transport = _Pipe()
    return serve_on(transport, app, limits), transport


def _statuses_and_bodies(transport: _Transport) -> list[tuple[bytes, bytes]]:
    return [(head[9:12], body) for head, body in _responses(b"".join(transport.writes))]


def test_a_pipeline_is_taken_up_to_its_depth_then_the_connection_closes() -> None:
    """One read of 100 pipelined requests used to queue all of them (about 2.4 KB each,
    for as long as the client did not read). Now PIPELINE_DEPTH wait behind the first:
    those are answered, in order, the last with Connection: close; then the connection
    half-closes, drops what the client still sends, and closes by keep_alive_timeout_s."""

    async def scenario() -> tuple[int, _Pipe, list[bytes]]:
        limits = ConnectionLimits(keep_alive_timeout_s=0.2)
        protocol, transport = _connection(limits)
        try:
            protocol.data_received(b"".join(_get(f"/r{i}") for i in range(100)))
            waiting = len(protocol.pipeline)
            await eventually(lambda: transport.eof, what="the half-close after the answers")
            protocol.data_received(_get("/late"))  # sent before the client saw the close
            await eventually(lambda: transport.closed, what="the close after lingering")
        finally:
            protocol.connection_lost(None)
        heads = [head for head, _ in _responses(b"".join(transport.writes))]
        return waiting, transport, heads

    waiting, transport, heads = asyncio.run(scenario())
    assert waiting == PIPELINE_DEPTH
    taken = PIPELINE_DEPTH + 1
    expected = [(b"200", f"/r{i}".encode()) for i in range(taken)]
    assert _statuses_and_bodies(transport) == expected  # /late: not answered
    closing = [b"connection: close" in head for head in heads]
    assert closing == [False] * (taken - 1) + [True]


def test_whole_requests_before_a_head_in_one_read_do_not_count_toward_its_size() -> None:
    """Eight pipelined requests of 1 KB and the start of a ninth in one read, under a 4 KB
    head limit: the read ended inside the ninth head, and the whole read was counted as
    that head (431). Each head is under the limit, so all nine are answered."""

    async def scenario() -> _Pipe:
        protocol, transport = _connection(ConnectionLimits(max_header_bytes=4096))
        try:
            ninth = _get("/r8", pad=1000)
            protocol.data_received(
                b"".join(_get(f"/r{i}", pad=1000) for i in range(8)) + ninth[:40]
            )
            protocol.data_received(ninth[40:])
            await eventually(lambda: len(transport.writes) >= 9, what="nine answers")
            assert not transport.closed
        finally:
            protocol.connection_lost(None)
        return transport

    transport = asyncio.run(scenario())
    assert _statuses_and_bodies(transport) == [(b"200", f"/r{i}".encode()) for i in range(9)]


_OVER = (b"GET /big HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 3000, b"a" * 3000)


@pytest.mark.parametrize(
    ("reads", "status"),
    [(_OVER, b"431"), ((b"NOT HTTP AT ALL\r\n\r\n",), b"400")],
    ids=["head-over-limit", "malformed"],
)
def test_a_refusal_behind_pipelined_requests_comes_after_their_answers(
    reads: tuple[bytes, ...], status: bytes
) -> None:
    """Three requests still being answered, then a head over the 4 KB limit (counted in
    the read it began in and the next) or bytes that are not HTTP: the refusal used to be
    written at once, where the client reads it as the first request's answer. It comes
    after the three answers, and then the connection closes."""

    async def scenario() -> tuple[list[bytes], _Pipe]:
        gate = asyncio.Event()
        protocol, transport = _connection(ConnectionLimits(max_header_bytes=4096), gate)
        try:
            pipelined = b"".join(_get(f"/r{i}") for i in range(3))
            for i, data in enumerate(reads):
                protocol.data_received(pipelined + data if i == 0 else data)
            before = list(transport.writes)  # the answers wait for the gate
            gate.set()
            await eventually(lambda: transport.closed, what="the refusal and the close")
        finally:
            protocol.connection_lost(None)
        return before, transport

    before, transport = asyncio.run(scenario())
    assert before == []
    answers = _statuses_and_bodies(transport)
    assert answers[:3] == [(b"200", f"/r{i}".encode()) for i in range(3)]
    assert [code for code, _ in answers[3:]] == [status]


def test_deadlines_run_from_a_heads_first_byte_and_its_end_across_reads() -> None:
    """A deadline is set only where a read ends inside a head or a body, at that read's
    end: the head's from the read its first byte came in, the body's from the read its
    head ended in; later reads of either move neither, and a request whole in one read
    sets none (the usual request arms, moves and clears nothing)."""
    limits = ConnectionLimits(header_timeout_s=10.0, body_timeout_s=60.0)

    async def scenario() -> list[tuple[float, float, float | None]]:
        protocol, _ = _connection(limits)
        loop = asyncio.get_running_loop()
        body = b'{"x": 1}'
        reads = [
            b"POST /x HTTP/1.1\r\nHost: a\r\n",  # the head begins
            b"X-More: 1\r\n",  # and goes on
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:3]),  # the body begins
            body[3:6],
            body[6:] + _get("/whole"),  # the body's end, and a whole request
        ]
        seen = []
        try:
            for data in reads:
                before = loop.time()
                protocol.data_received(data)
                seen.append((before, loop.time(), protocol._late_at))
                await asyncio.sleep(0.01)
        finally:
            protocol.connection_lost(None)
        return seen

    seen = asyncio.run(scenario())
    head_at, body_at = seen[0][2], seen[2][2]
    assert head_at is not None
    assert seen[0][0] + 10.0 <= head_at <= seen[0][1] + 10.0
    assert seen[1][2] == head_at  # more of the head: its deadline stays
    assert body_at is not None
    assert seen[2][0] + 60.0 <= body_at <= seen[2][1] + 60.0
    assert seen[3][2] == body_at  # more of the body: its deadline stays
    assert seen[4][2] is None  # the body ended, and the whole request after it set none
