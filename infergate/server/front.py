"""A front process (`[server] fronts = N`): the HTTP side of the gateway, in front of the
engine process, so that parsing, the edge limits and the socket writes of N fronts run
beside the engine's loop instead of on it.

Each front listens on the gateway's port (SO_REUSEPORT: the kernel spreads connections
over the fronts) with the gateway's own protocol (server/http_protocol.py: the same
limits, deadlines and one-write answers). A small infer request takes the infer lane
(server/infer_lane.py) as in one process, its answer asked of the engine's
`InferRoute.reply` over the link (`ForwardRoute`); the lane's access-log line and drain
count are the front's. Every other request goes to the engine as it comes
(`ForwardApp`: its head, then its body piece by piece) and runs through the engine's
whole app there: access log, drain, routes, errors. The front holds no state of its own:
one that dies is started again by the engine (server/fronts.py), and one whose engine
is gone exits.

The engine starts it as `python -m infergate.server.front CONFIG`, CONFIG being the JSON
that `fronts.front_config` writes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send

from infergate.errors import BrokenOff, ClientGone, InfergateError
from infergate.server.decoding import KEPT_NOTHING
from infergate.server.departure import Departure, cancelled_error, is_departure, unless_gone
from infergate.server.drain import (
    NOT_WAITED_FOR,
    OUT_OF_TIME,
    Drain,
    DrainingServer,
    shutting_down,
)
from infergate.server.http_protocol import ConnectionLimits, GatewayHttpProtocol
from infergate.server.infer_lane import InferLane
from infergate.server.infer_request import api_key
from infergate.server.link import LinkProtocol, Message
from infergate.server.predecode import encode_answer, pack
from infergate.server.read_gate import ReadGate
from infergate.server.reply import Reply, internal_error

log = logging.getLogger("infergate.server")

# A request whose key headers are refused (two keys, a bare Bearer): never decoded here.
_BAD_KEY = "\x00refused key headers"


# Pieces of one forwarded answer waiting for a slow client: as many as the event bus keeps
# for a slow reader of /admin/events in one process (engine/events.py).
STREAM_BACKLOG = 1000


class EngineLink:
    """The front's end of the link: requests out, each answer to whoever waits for it."""

    def __init__(self, read_gate: ReadGate | None = None) -> None:
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Message]] = {}
        self._streams: dict[int, asyncio.Queue[Message]] = {}
        self.link: LinkProtocol | None = None
        # Held while the engine falls behind reading what this front sends (read_gate.py).
        self.read_gate = read_gate

    async def connect(self, path: str, on_lost: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        _, self.link = await loop.create_unix_connection(
            lambda: LinkProtocol(self._on_message, on_lost, on_writable=self._writable), path
        )

    def _writable(self, writable: bool) -> None:
        gate = self.read_gate
        if gate is not None:
            if writable:
                gate.release()
            else:
                gate.hold()

    def send(self, message: Message, size: int = 0) -> None:
        """`size`: the bytes of a body `message` carries (see `LinkProtocol.send`)."""
        assert self.link is not None
        self.link.send(message, size)

    async def drained(self) -> None:
        assert self.link is not None
        await self.link.drained()

    def _on_message(self, message: Message) -> None:
        kind, rid = message[0], message[1]
        if kind == "reply" or kind == "result":
            waiter = self._replies.pop(rid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        else:  # "want" (its body), "start", "chunk" or "abort" of a forwarded request
            stream = self._streams.get(rid)
            if stream is None:
                return
            if stream.qsize() < STREAM_BACKLOG:
                stream.put_nowait(message)
                return
            # Its client reads slower than the engine answers, without end (an event
            # stream it does not read): the answer breaks off here rather than fill the
            # front's memory, and the engine stops producing it.
            del self._streams[rid]
            self.send(("cancel", rid))
            stream.put_nowait(("abort", rid))

    async def ask(self, message: Callable[[int], Message]) -> Message:
        """Send the message `message(rid)` and await the engine's reply to it."""
        rid = next(self._ids)
        waiter = asyncio.get_running_loop().create_future()
        self._replies[rid] = waiter
        try:
            self.send(message(rid))
            answer: Message = await waiter
            return answer
        except asyncio.CancelledError as exc:
            if is_departure(exc) and self._replies.get(rid) is waiter:  # the engine drops it too
                self.send(("cancel", rid))
            raise  # (else the front stops: the engine answers it, as in one process)
        finally:
            self._replies.pop(rid, None)

    def ask_soon(
        self,
        message: Callable[[int], Message],
        answered: Callable[[asyncio.Future[Message]], None],
        size: int = 0,
    ) -> asyncio.Future[Message]:
        """`ask` without a coroutine: `answered` gets the future the engine's reply settles
        (or that is cancelled instead), which is returned."""
        rid = next(self._ids)
        waiter: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._replies[rid] = waiter

        def done(settled: asyncio.Future[Message]) -> None:
            # A reply popped it already; a cancel did not. One because its client left
            # has the engine drop the request too (server/departure.py).
            if (
                self._replies.pop(rid, None) is not None
                and settled.cancelled()
                and is_departure(cancelled_error(settled))
            ):
                self.send(("cancel", rid))
            answered(settled)

        waiter.add_done_callback(done)
        self.send(message(rid), size)
        return waiter

    def open_stream(self) -> tuple[int, asyncio.Queue[Message]]:
        rid = next(self._ids)
        stream: asyncio.Queue[Message] = asyncio.Queue()
        self._streams[rid] = stream
        return rid, stream

    def close_stream(self, rid: int) -> None:
        self._streams.pop(rid, None)


# What a front remembers of the engine's answers, to decide what it decodes: the paths a
# key was served on, and the keys told to come back later.
_KNOWN_PATHS = 4096
_HELD_KEYS = 4096
_HOLD_MAX_S = 10.0  # the longest a Retry-After stops decoding (a remote model's may be hours)
# Refusals the engine gives a key on a path before decoding its body (401 no key, 403 not
# allowed, 404 no such model or version, 424 a model that failed to load).
_REFUSED = frozenset({401, 403, 404, 424})

# A key (None: no key), a model and the version its path names.
InferPath = tuple[str | None, str, str | None]


class ForwardRoute:
    """The infer lane's route in a front: the engine's `InferRoute` answers. The usual
    request goes decoded here (server/predecode.py), beside its body, once the engine has
    served its key on its path (model and version) before, and has not since refused it
    there or told the key to come back later. Anything else goes as its body alone, and
    the engine refuses it before decoding it as in one process: a stranger's key (401), a
    model it may not use (403) or that does not exist (404), a tenant over its rate or
    concurrency (429, until its Retry-After) costs no decoding in the front either, where
    it would cost other tenants' requests a front's time (a 64 KiB body: milliseconds)."""

    def __init__(self, engine: EngineLink, max_body: int) -> None:
        self._engine = engine
        self._max_body = max_body
        # Paths the engine answered 200 on lately, oldest first; one it refuses (401:
        # revoked, say) is forgotten.
        self._known: dict[InferPath, None] = {}
        # Keys answered with a Retry-After (over a limit, a model not ready), until when.
        self._held: dict[str | None, float] = {}

    async def reply(
        self,
        name: str,
        version: str | None,
        raw_headers: list[tuple[bytes, bytes]],
        receive: Receive,
        whole: bytes | None = None,
        departure: Departure | None = None,
    ) -> Reply:
        arrived = time.monotonic()  # the lane starts this at the request's head
        body = whole
        if body is None:  # the lane's receive: the whole (small) body, or a disconnect
            message = await receive()
            body = message.get("body", b"") if message["type"] == "http.request" else None
        try:
            if departure is not None and departure.gone:
                raise ClientGone()
            asked = self._engine.ask(
                lambda rid: ("infer", rid, name, version, raw_headers, body, arrived)
            )
            answer = await unless_gone(departure, asked)
        except ClientGone:  # (a wait cut short: the engine was told, and drops it: `ask`)
            return Reply(ClientGone.status, [], b"", "-", KEPT_NOTHING)
        _, _, status, headers, content, tenant = answer
        return Reply(status, headers, content, tenant, KEPT_NOTHING)

    def answer_now(
        self,
        name: str,
        version: str | None,
        raw_headers: list[tuple[bytes, bytes]],
        whole: bytes,
        respond: Callable[[Reply | None], None],
        *,
        headers_in: dict[bytes, bytes] | None = None,
    ) -> asyncio.Future[Message]:
        """`reply` without a task, for the lane's usual request (its whole body here): the
        engine's answer goes to `respond` as it arrives (None: cancelled, the front is
        stopping). What the answer waits on is returned, for the lane's drain to cancel.
        `headers_in`: `raw_headers` as a dict, when the caller made it already."""
        arrived = time.monotonic()
        if headers_in is None:
            headers_in = dict(raw_headers)
        try:
            key = api_key(headers_in, raw_headers)
        except InfergateError:  # the engine answers it (a 400 or 401), not decoded here
            key = _BAD_KEY
        path = (key, name, version)
        both = pack(whole, headers_in, self._max_body) if self._decodes(path, arrived) else None
        decoded, packed = (None, None) if both is None else both

        def answered(waiter: asyncio.Future[Message]) -> None:
            if waiter.cancelled():
                respond(None)
                return
            message = waiter.result()
            if message[0] == "result":  # a 200, encoded here
                _, _, tenant, outputs = message
                assert decoded is not None, "a result for a request sent undecoded"
                try:
                    headers, content = encode_answer(outputs, decoded, raw_headers)
                except Exception:  # a bug: answered 500, never left hanging
                    log.exception("infer %s: encoding its answer failed", name)
                    respond(internal_error())
                    return
                status = 200
            else:
                _, _, status, headers, content, tenant = message
            self._learn(path, status, headers)
            respond(Reply(status, headers, content, tenant, KEPT_NOTHING))

        return self._engine.ask_soon(
            lambda rid: ("infer", rid, name, version, raw_headers, whole, arrived, packed),
            answered,
            len(whole),
        )

    def _decodes(self, path: InferPath, now: float) -> bool:
        """Whether a request on `path` is decoded here (see the class docstring)."""
        if path not in self._known:
            return False
        held = self._held
        if held:
            until = held.get(path[0])
            if until is not None:
                if now < until:
                    return False
                del held[path[0]]
        return True

    def _learn(self, path: InferPath, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """What the engine's answer says of `path`: served (200), refused before any
        decoding, or to come back later (its Retry-After)."""
        known = self._known
        if status == 200:
            if path not in known:
                if len(known) >= _KNOWN_PATHS:
                    del known[next(iter(known))]
                known[path] = None
            return
        if status in _REFUSED:
            known.pop(path, None)
        if path not in known:  # (a stranger's answer: nothing to hold)
            return
        for name, value in headers:
            if name == b"retry-after":
                if value.isdigit() and len(value) < 8:
                    held = self._held
                    held.pop(path[0], None)  # (to the end: the oldest go first)
                    if len(held) >= _HELD_KEYS:
                        del held[next(iter(held))]
                    held[path[0]] = time.monotonic() + min(int(value), _HOLD_MAX_S)
                break


class ForwardApp:
    """Every request the lane does not take: its head, then its body as it arrives, to the
    engine, which runs it through its whole app; the answer comes back as it is sent."""

    def __init__(self, engine: EngineLink, drain: Drain, max_body: int) -> None:
        self._engine = engine
        self._drain = drain
        # More than this the engine refuses (413) once it has read it: what it is sent
        # of a body stops there, so that it never holds more than one process would.
        self._max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan here (the engine's), and no websockets served
        counted = scope["path"] not in NOT_WAITED_FOR  # the drain waits for it
        rid, stream = self._engine.open_stream()
        head = (
            "http",
            rid,
            scope["method"],
            scope["path"],
            scope["raw_path"],
            scope["query_string"],
            scope["headers"],
            scope["client"],
            scope["http_version"],
            time.monotonic(),  # its arrival, for the engine's drain
        )
        self._engine.send(head)
        if counted:
            self._drain.in_flight += 1
        pump: asyncio.Task[None] | None = None  # started once the engine wants the body
        finished = started = False
        try:
            while not finished:
                message = await stream.get()
                if message[0] == "want":
                    pump = asyncio.create_task(self._pump(rid, receive, stream))
                    continue
                if message[0] == "gone":  # the client left (the pump saw it)
                    return
                if message[0] == "abort":
                    raise BrokenOff(
                        f"{scope['method']} {scope['path']}: the engine's answer broke off"
                    )
                if message[0] == "start":
                    started = True
                    await send(
                        {"type": "http.response.start", "status": message[2], "headers": message[3]}
                    )
                else:
                    _, _, body, more = message
                    await send({"type": "http.response.body", "body": body, "more_body": more})
                    finished = not more
        except asyncio.CancelledError:
            if not self._drain.draining:
                raise
            # The drain time ran out before the engine answered, and uvicorn cancelled
            # this: the JSON 503 one process gives (uvicorn's own is a text/plain 500).
            if not started:
                headers, content = shutting_down(OUT_OF_TIME)
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": content})
        finally:
            if pump is not None:
                pump.cancel()
            self._engine.close_stream(rid)
            if counted:
                self._drain.in_flight -= 1
            if not finished:  # cancelled (the drain ran out, the client left): stop there too
                self._engine.send(("cancel", rid))

    async def _pump(self, rid: int, receive: Receive, stream: asyncio.Queue[Message]) -> None:
        """The body to the engine, as fast as the link takes it; then, until the answer
        ends (this is cancelled then), the client's leaving, which ends the request in
        the engine too (an event stream's above all)."""
        sent, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            body = message.get("body", b"")
            more = bool(message.get("more_body", False))
            sent += len(body)
            self._engine.send(("body", rid, body, more), len(body))
            if sent > self._max_body:  # the engine answers 413 as it reads it
                await asyncio.get_running_loop().create_future()  # the answer cancels this
            await self._engine.drained()
        else:
            while (await receive())["type"] != "http.disconnect":
                pass
        self._engine.send(("cancel", rid))
        stream.put_nowait(("gone", rid))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket on the gateway's address that shares it with the other fronts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class _FrontServer(DrainingServer):
    """uvicorn with our drain, which joins the engine's link before it listens and tells
    the engine once it does."""

    def __init__(
        self, config: uvicorn.Config, drain: Drain, settings: dict[str, Any], engine: EngineLink
    ) -> None:
        super().__init__(config, drain, float(settings["drain_timeout_s"]))
        self.settings = settings
        self.engine = engine

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.engine.connect(self.settings["link"], _engine_gone)
        await super().startup(sockets)
        if self.started:
            self.engine.send(("listening", os.getpid()))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # What uvicorn has just cancelled (past the drain time) answers 503 as it ends
        # (infer_lane.py); the engine's process awaits its lifespan here, a front nothing.
        if self.server_state.tasks:
            await asyncio.wait(list(self.server_state.tasks), timeout=1.0)


def _engine_gone() -> None:
    """The engine's end closed: it died (a stopping engine waits for its fronts). Nothing
    here can answer any more, so the front goes too, at once."""
    log.error("front %d: the engine is gone; exiting", os.getpid())
    os._exit(1)


def main(config_json: str) -> None:
    from infergate import procname
    from infergate.cli.logs import configure

    settings = json.loads(config_json)
    procname.set_name(b"ig-front")
    configure(settings["log_level"], settings["log_format"], settings["access_log"])
    drain = Drain()
    limits = ConnectionLimits(**settings["limits"])
    gate = ReadGate()
    engine = EngineLink(gate)
    max_body = int(settings["max_request_bytes"])
    config = uvicorn.Config(
        ForwardApp(engine, drain, max_body),
        http=GatewayHttpProtocol.with_limits(
            limits, InferLane(ForwardRoute(engine, max_body), drain), gate
        ),
        ws="none",  # no WebSockets: an Upgrade is ignored (server/http_protocol.py)
        log_level=settings["log_level"],
        log_config=None,
        lifespan="off",  # the engine's
        proxy_headers=False,
        server_header=False,
        access_log=False,
        timeout_keep_alive=max(1, int(settings["keep_alive_s"])),
        timeout_graceful_shutdown=1,
    )
    server = _FrontServer(config, drain, settings, engine)
    gate.connections = server.server_state.connections
    sock = listening_socket(settings["host"], settings["port"])
    server.run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1])
