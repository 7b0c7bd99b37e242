"""The infer lane (server/infer_lane.py): small infer requests are answered by the HTTP
protocol without an ASGI cycle, and a client cannot tell them from the ones the ASGI route
answers: the same status, headers and body, errors included, in order on a connection,
closing it when asked."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from starlette.types import Receive, Scope, Send

from infergate.engine.admission.tenants import hash_key
from infergate.server.access_log import request_id
from infergate.server.decoding import Keeper
from infergate.server.departure import Departure
from infergate.server.http_protocol import ConnectionLimits, GatewayHttpProtocol
from infergate.server.infer_lane import _LANE_PATH, LANE_MAX_BODY, InferLane
from infergate.server.infer_route import INFER_PATH
from infergate.server.one_write import JOIN_AT_MOST
from infergate.server.reply import Reply
from tests.edge_raw import Reply as RawReply
from tests.edge_raw import closed_by_server, connect, read_replies, read_reply
from tests.fake_connection import serve_on
from tests.onnx_models import make_mlp
from tests.polling import eventually
from tests.server import ServerProcess

KEY = "lane-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("lane")
    make_mlp(tmp / "models" / "mlp" / "1" / "model.onnx")
    profile = tmp / "profile.toml"
    profile.write_text(
        f"[server]\nkeep_alive_timeout_s = 2\n\n"
        f'[tenants.team]\napi_keys = ["{hash_key(KEY)}"]\nrps = 1000\n'
    )
    server = ServerProcess(tmp / "models", profile, tmp / "server.log").start()
    yield server
    server.stop()


def _request(
    path: str, body: bytes, headers: dict[str, str], chunked: bool, version: str = "1.1"
) -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: gateway"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if chunked:  # a streamed body: the ASGI route's
        lines.append("Transfer-Encoding: chunked")
        framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    else:
        lines.append(f"Content-Length: {len(body)}")
        framed = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + framed


def _exchange(port: int, request: bytes, answers: int = 1) -> list[RawReply]:
    """Send `request` (one or several, pipelined) and read `answers` replies."""
    with connect(port) as sock:
        sock.sendall(request)
        replies = read_replies(sock, answers)
    assert len(replies) == answers, f"the server closed the connection after {len(replies)}"
    return replies


_GOOD = orjson.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [0.5] * 8}]}
)
CASES = {
    "answer": ("/v2/models/mlp/infer", _GOOD, {"X-API-Key": KEY}),
    "version": ("/v2/models/mlp/versions/1/infer?x=1", _GOOD, {"X-API-Key": KEY}),
    "unknown model": ("/v2/models/nope/infer", _GOOD, {"X-API-Key": KEY}),
    "no such version": ("/v2/models/mlp/versions/7/infer", _GOOD, {"X-API-Key": KEY}),
    "bad key": ("/v2/models/mlp/infer", _GOOD, {"X-API-Key": "wrong"}),
    "no key": ("/v2/models/mlp/infer", _GOOD, {}),
    "not JSON": ("/v2/models/mlp/infer", b"{nope", {"X-API-Key": KEY}),
    "wrong shape": (
        "/v2/models/mlp/infer",
        _GOOD.replace(b"[2,4]", b"[2,5]"),
        {"X-API-Key": KEY},
    ),
    "empty body": ("/v2/models/mlp/infer", b"", {"X-API-Key": KEY}),
    "gzip asked": ("/v2/models/mlp/infer", _GOOD, {"X-API-Key": KEY, "Accept-Encoding": "gzip"}),
}


@pytest.mark.parametrize("case", CASES)
def test_the_lane_answers_as_the_asgi_route_does(server: ServerProcess, case: str) -> None:
    path, body, headers = CASES[case]
    headers = {
        **headers,
        "Content-Type": "application/json",
        "X-Request-ID": f"id-{case.replace(' ', '-')}",
    }
    lane = _exchange(server.port, _request(path, body, headers, chunked=False))[0]
    routed = _exchange(server.port, _request(path, body, headers, chunked=True))[0]
    assert (lane.status, lane.body) == (routed.status, routed.body)
    same = ("content-type", "content-length", "content-encoding", "retry-after", "x-request-id")
    assert {h: lane.headers.get(h) for h in same} == {h: routed.headers.get(h) for h in same}
    assert lane.headers["x-request-id"] == f"id-{case.replace(' ', '-')}"
    assert "date" in lane.headers


@pytest.mark.parametrize(
    ("path", "key", "status"),
    [
        ("/v2/models/mlp/infer", "wrong", 401),
        ("/v2/models/nope/infer", KEY, 404),
    ],
)
def test_a_small_request_is_refused_before_its_body_arrives(
    server: ServerProcess, path: str, key: str, status: int
) -> None:
    """Admission comes before the body on the lane too: a client that stalls halfway
    through a small body is answered at once, not after the body timeout (60 s here)."""
    request = _request(path, _GOOD, {"X-API-Key": key}, chunked=False)
    with connect(server.port) as sock:
        sock.sendall(request[: len(request) - len(_GOOD) // 2])  # half of the body held back
        reply = read_reply(sock, timeout_s=20)
    assert reply is not None
    assert reply.status == status


def test_a_connection_refused_before_its_body_still_closes_when_idle(
    server: ServerProcess,
) -> None:
    """The rest of the body comes after the refusal; then the connection idles and is
    closed after keep_alive_timeout_s (2 s here), as after any answer."""
    request = _request("/v2/models/mlp/infer", _GOOD, {"X-API-Key": "wrong"}, chunked=False)
    half = len(request) - len(_GOOD) // 2
    with connect(server.port) as sock:
        sock.sendall(request[:half])
        reply = read_reply(sock, timeout_s=20)
        assert reply is not None
        assert reply.status == 401
        sock.sendall(request[half:])
        closed, _ = closed_by_server(sock, timeout_s=20)
    assert closed


def test_a_content_length_of_thousands_of_digits_is_a_400(server: ServerProcess) -> None:
    head = (
        "POST /v2/models/mlp/infer HTTP/1.1\r\nHost: gateway\r\nX-API-Key: "
        f"{KEY}\r\nContent-Length: {'0' * 5000}2\r\n\r\n"
    ).encode()
    with connect(server.port) as sock:
        sock.sendall(head + b"{}")
        reply = read_reply(sock)
    assert reply is not None
    assert reply.status == 400
    assert "Content-Length has 5001 digits" in str(reply.json()["error"])


def test_pipelined_requests_are_answered_in_order(server: ServerProcess) -> None:
    """Lane and ASGI requests sent back to back on one connection, in one write."""

    def body(value: float) -> bytes:
        return _GOOD.replace(b"0.5", str(value).encode())

    auth = {"X-API-Key": KEY}
    requests = [
        _request("/v2/models/mlp/infer", body(1.0), auth, chunked=False),
        b"GET /v2/health/live HTTP/1.1\r\nHost: gateway\r\n\r\n",
        _request("/v2/models/mlp/infer", body(2.0), auth, chunked=True),
        _request("/v2/models/mlp/infer", body(3.0), auth, chunked=False),
        _request("/v2/models/nope/infer", body(4.0), auth, chunked=False),
    ]
    replies = _exchange(server.port, b"".join(requests), answers=5)
    assert [r.status for r in replies] == [200, 200, 200, 200, 404]
    assert replies[1].json() == {"live": True}
    singly = [
        _exchange(server.port, _request("/v2/models/mlp/infer", body(v), auth, False))[0]
        for v in (1.0, 2.0, 3.0)
    ]
    assert [replies[i].body for i in (0, 2, 3)] == [r.body for r in singly]
    assert len({r.body for r in singly}) == 3


@pytest.mark.parametrize(("version", "headers"), [("1.1", {"Connection": "close"}), ("1.0", {})])
def test_a_connection_asked_to_close_is_closed_after_the_answer(
    server: ServerProcess, version: str, headers: dict[str, str]
) -> None:
    request = _request("/v2/models/mlp/infer", _GOOD, {**headers, "X-API-Key": KEY}, False, version)
    with connect(server.port) as sock:
        sock.sendall(request)
        reply = read_reply(sock)
        assert reply is not None
        assert reply.status == 200
        assert reply.headers["connection"] == "close"
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed by the server


# Which requests take the lane, at the protocol: the lane's route and the ASGI app each
# record what they answered.


class _Route:
    def __init__(self, fail: bool = False, fail_now: bool = False, answer: bytes = b"lane") -> None:
        self.bodies: list[bytes] = []
        self.fail = fail
        self.fail_now = fail_now
        self.answer = answer

    def answer_now(self, *args: Any, **kwargs: Any) -> None:
        if self.fail_now:
            raise RuntimeError("a bug in the task-free way")
        return None  # every request through `reply`, which this stand-in answers

    async def reply(
        self,
        name: str,
        version: str | None,
        headers: list[tuple[bytes, bytes]],
        receive: Any,
        whole: bytes | None = None,
        departure: Departure | None = None,
    ) -> Reply:
        self.bodies.append((await receive())["body"] if whole is None else whole)
        if self.fail:
            raise RuntimeError("a bug")
        length = str(len(self.answer)).encode()
        return Reply(200, [(b"content-length", length)], self.answer, "-", Keeper())


class _Transport:
    def __init__(self) -> None:
        self.data = b""
        self.writes: list[bytes] = []  # each write's bytes, as given
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name in ("peername", "sockname") else None

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _connected(
    lane: InferLane, app: Any, limits: ConnectionLimits = GatewayHttpProtocol.limits
) -> tuple[GatewayHttpProtocol, _Transport]:
    """A protocol with `lane`, serving `app` otherwise, on a fresh fake connection."""
    transport = _Transport()
    return serve_on(transport, app, limits, lane), transport


def _small(extra: str = "", path: str = "/v2/models/m/infer", length: int = 2) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {length}\r\n{extra}\r\n"
    return head.encode() + b"{}"[:length] + b" " * max(0, length - 2)


WHO_ANSWERS = {
    "small infer": (_small(), "lane"),
    "a version's infer": (_small(path="/v2/models/m/versions/2/infer"), "lane"),
    "the largest lane body": (_small(length=LANE_MAX_BODY), "lane"),
    "a larger body": (_small(length=LANE_MAX_BODY + 1), "asgi"),
    "a chunked body": (
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n",
        "asgi",
    ),
    "Expect: 100-continue": (_small("Expect: 100-continue\r\n"), "asgi"),
    "an escaped path": (_small(path="/v2/models/m%2Dx/infer"), "asgi"),
    "a GET": (b"GET /v2/models/m/infer HTTP/1.1\r\nHost: a\r\n\r\n", "asgi"),
    "another path": (_small(path="/v2/models/m/infer/x"), "asgi"),
}


@pytest.mark.parametrize("case", WHO_ANSWERS)
def test_which_requests_take_the_lane(case: str) -> None:
    data, expected = WHO_ANSWERS[case]
    route = _Route()
    asgi_calls: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        asgi_calls.append(scope["path"])
        while (await receive()).get("more_body"):
            pass
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]}
        )
        await send({"type": "http.response.body", "body": b"asgi"})

    async def scenario() -> bytes:
        lane = InferLane(route)  # a stand-in for InferRoute
        protocol, transport = _connected(lane, app)
        try:
            protocol.data_received(data)
            await eventually(lambda: transport.data.endswith((b"lane", b"asgi")), what="answer")
        finally:
            protocol.connection_lost(None)
        return transport.data

    answer = asyncio.run(scenario())
    assert answer.endswith(expected.encode())
    assert (len(route.bodies), len(asgi_calls)) == ((1, 0) if expected == "lane" else (0, 1))
    if expected == "lane":
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"\r\nx-request-id: " in answer
        assert len(route.bodies[0]) == int(data.split(b"Content-Length: ")[1].split(b"\r\n")[0])


@pytest.mark.parametrize("way", ["lane", "asgi"])
@pytest.mark.parametrize("size", [JOIN_AT_MOST, JOIN_AT_MOST + 1])
def test_a_large_body_is_sent_as_it_is_after_its_head(way: str, size: int) -> None:
    """A body over 64 KB goes in a write of its own, the very bytes the route or the app
    made: joined to its head it was copied on the event loop (about 100 ms for 160 MB,
    every other connection waiting). A smaller one goes with its head, in one send."""
    body = b"x" * size
    health = b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\n\r\n"  # (the app answers it)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        length = str(size).encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", length)]}
        )
        await send({"type": "http.response.body", "body": body})

    async def scenario() -> list[bytes]:
        lane = InferLane(_Route(answer=body))
        protocol, transport = _connected(lane, app)
        try:
            protocol.data_received(_small() if way == "lane" else health)
            await eventually(lambda: transport.data.endswith(body), what="the answer")
        finally:
            protocol.connection_lost(None)
        return transport.writes

    writes = asyncio.run(scenario())
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    if size > JOIN_AT_MOST:
        assert writes[0].endswith(b"\r\n\r\n")
        assert writes[1] is body
    else:
        assert writes[0].endswith(b"\r\n\r\n" + body)
    assert len(writes) == 1 + (size > JOIN_AT_MOST)


@pytest.mark.parametrize("where", ["reply", "answer_now"])
def test_a_bug_on_the_lane_is_a_500_and_the_connection_closes(where: str) -> None:
    """What uvicorn's cycle does for an exception in the app, in the gateway's JSON: in
    the route's task, or in the way without one (`answer_now`)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the lane's request reached the ASGI app")

    async def scenario() -> tuple[bytes, bool]:
        route = _Route(fail=where == "reply", fail_now=where == "answer_now")
        lane = InferLane(route)  # a stand-in route
        protocol, transport = _connected(lane, app)
        try:
            protocol.data_received(_small())
            await eventually(lambda: transport.closed, what="the connection closed")
        finally:
            protocol.connection_lost(None)
        return transport.data, transport.closed

    answer, closed = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 500 ")
    assert b"\r\nconnection: close\r\n" in answer
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"].startswith("internal error")
    assert closed


def test_a_closed_connection_is_freed_without_the_cycle_collector() -> None:
    """The gateway runs the cyclic collector rarely (cli/serve.py's _tune_gc): a lane
    request must leave nothing in a reference cycle, its connection's protocol and its
    cycle included."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the lane's request reached the ASGI app")

    async def scenario() -> weakref.ref[Any]:
        lane = InferLane(_Route())  # a stand-in route
        protocol, transport = _connected(lane, app)
        protocol.data_received(_small("Connection: close\r\n"))
        await eventually(lambda: transport.closed and not protocol.tasks, what="the answer")
        protocol.connection_lost(None)
        return weakref.ref(protocol)

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        protocol = asyncio.run(scenario())
        assert protocol() is None
        gc.collect()
        left = {type(o).__name__ for o in gc.garbage} & {"LaneCycle", "GatewayHttpProtocol"}
        assert not left
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


class _RefuseThenHold:
    """A stand-in route: the first request is refused before its body is read, the
    second is answered once `release` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()

    def answer_now(self, *args: Any, **kwargs: Any) -> None:
        return None  # every request through `reply`, which this stand-in answers

    async def reply(
        self,
        name: str,
        version: str | None,
        headers: list[tuple[bytes, bytes]],
        receive: Any,
        whole: bytes | None = None,
        departure: Departure | None = None,
    ) -> Reply:
        self.calls += 1
        if self.calls == 1:
            return Reply(401, [(b"content-length", b"6")], b"denied", "-", Keeper())
        await receive()
        await self.release.wait()
        return Reply(200, [(b"content-length", b"4")], b"lane", "-", Keeper())


def test_a_request_after_a_refused_body_is_not_cut_by_the_idle_timer() -> None:
    """The refused request's body ends in the same read as the next request begins: that
    request runs past the keep-alive time (0.1 s here) and is still answered."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the lane's request reached the ASGI app")

    async def scenario() -> tuple[bool, bytes]:
        route = _RefuseThenHold()
        limits = ConnectionLimits(keep_alive_timeout_s=0.1)
        protocol, transport = _connected(InferLane(route), app, limits)
        first = _small(length=10)
        protocol.data_received(first[:-5])  # the head and half the body
        await eventually(lambda: transport.data.endswith(b"denied"), what="the refusal")
        protocol.data_received(first[-5:] + _small())  # the rest, and the next request
        await asyncio.sleep(0.5)  # five keep-alive times, the second request still held
        cut = transport.closed
        route.release.set()
        await eventually(lambda: transport.data.endswith(b"lane") or transport.closed, what="2")
        protocol.connection_lost(None)
        return cut, transport.data

    cut, data = asyncio.run(scenario())
    assert not cut
    assert data.count(b"HTTP/1.1 ") == 2
    assert data.endswith(b"lane")


@pytest.mark.parametrize(
    "sent",
    [
        [(b"x-request-id", b"abc-1")],
        [(b"x-request-id", b"not sane"), (b"x-request-id", b"sane-2")],
        [(b"x-request-id", b"sane-1"), (b"x-request-id", b"sane-2")],
        [(b"x-request-id", b"sane-1"), (b"host", b"a"), (b"x-request-id", b"not sane")],
        [(b"x-request-id", b"not sane")],
        [(b"host", b"a")],
    ],
)
def test_the_lanes_request_id_is_the_first_sane_one_as_the_asgi_routes(
    sent: list[tuple[bytes, bytes]],
) -> None:
    """The lane looks the id up in the headers' dict, which keeps the last of a name sent
    twice: it reads the list then, as the ASGI route does, so the first sane id counts."""
    plain, by_name = request_id(sent), request_id(sent, dict(sent))
    sane = [v for n, v in sent if n == b"x-request-id" and v.replace(b"-", b"").isalnum()]
    if sane:
        assert plain == by_name == sane[0]
    else:  # a new one each time
        assert len(plain) == len(by_name) == 32
        assert plain != by_name


def test_the_lanes_path_is_the_infer_path_without_escapes() -> None:
    """The lane takes an infer path with no %-escape or "#" in it (the ASGI route decodes
    escapes), in one match of the whole URL: the same paths, and the same names, as the
    infer path's match on the URL's path (before its first "?") after a search for
    either."""
    paths = [
        "/v2/models/m/infer",
        "/v2/models/m/versions/2/infer",
        "/v2/models/m/versions//infer",
        "/v2/models/m%2Fx/infer",
        "/v2/models/m/versions/%32/infer",
        "/v2/models/m/infer#x",
        "/v2/models/m#/infer",
        "/v2/models/%/infer",
        "/v2/models//infer",
        "/v2/models/m/infer\n",
    ]
    rng = random.Random(7)
    pieces = ["m", "1", "%", "#", "/", "x%2F", "\n", "/infer"]

    def piece() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 3)))

    for _ in range(5000):
        version = f"/versions/{piece()}" if rng.random() < 0.5 else ""
        paths.append(f"/v2/models/{piece()}{version}/infer{rng.choice(['', '', '#', '/'])}")
    queries = ["", "", "?", "?a=1", "?/infer", "?%", "??", "?\n", "#?"]
    for path in paths:
        url = path + rng.choice(queries)
        lane = _LANE_PATH.match(url)
        path = url.partition("?")[0]
        before = None if "%" in path or "#" in path else INFER_PATH.match(path)
        assert (lane and lane.groups()) == (before and before.groups()), url
