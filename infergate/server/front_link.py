"""The engine's side of one front's link (`[server] fronts`, server/fronts.py): the
front's infer lane requests answered through `InferRoute.answer_now` (no task, decoded
by the front: server/predecode.py), every other request run through the engine's app as
uvicorn would run it, its body read from the front only once the app asks for it, and
the answers sent back over the link (server/link.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.types import Message

from infergate.errors import ClientGone
from infergate.server.departure import DEPARTURE_KEY, Departure, cancel_for_departure
from infergate.server.drain import ARRIVED_KEY, NEW_REQUEST, OUT_OF_TIME, shutting_down
from infergate.server.errors import error_body
from infergate.server.link import LinkProtocol
from infergate.server.link import Message as LinkMessage
from infergate.server.predecode import Packed, unpack
from infergate.server.reply import Reply, internal_error

if TYPE_CHECKING:
    from infergate.server.fronts import Fronts

log = logging.getLogger("infergate.server")

_PIECE = 64 << 20  # a forwarded answer's body goes to its front in pieces of at most this


class _Forwarded:
    """One forwarded request's body, as its pieces arrive, for the app's `receive`. The
    front sends none until the app first asks for it (`want`): a request the app refuses
    at its head (401, 403, 404, 429) costs its client no upload, and gets no `100
    Continue`, as in one process."""

    __slots__ = ("pieces", "gone", "departure", "_waiter", "_want")

    def __init__(self, want: Callable[[], None]) -> None:
        self.pieces: deque[tuple[bytes, bool]] = deque()
        self.gone = False
        self.departure = Departure()  # for the infer route (server/departure.py)
        self._waiter: asyncio.Future[None] | None = None
        self._want: Callable[[], None] | None = want

    def feed(self, body: bytes, more: bool) -> None:
        self.pieces.append((body, more))
        self._wake()

    def leave(self) -> None:
        self.gone = True
        self.departure.left()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def receive(self) -> Message:
        if self._want is not None:
            want, self._want = self._want, None
            want()
        while not self.pieces and not self.gone:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        if self.pieces:
            body, more = self.pieces.popleft()
            return {"type": "http.request", "body": body, "more_body": more}
        return {"type": "http.disconnect"}


class FrontLink:
    """One front's link, as the engine serves it."""

    def __init__(self, fronts: Fronts) -> None:
        self._fronts = fronts
        self._app = fronts.app
        self._route = fronts.route
        self._server = fronts.server_address
        self._drain = fronts.drain
        self._forwarded: dict[int, _Forwarded] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._infers: set[asyncio.Task[None]] = set()  # of those, the infer requests'
        self._departures: dict[int, Departure] = {}  # theirs, by request id
        # What the infer requests answered without a task wait on, by request id.
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.link = LinkProtocol(self._on_message, self._on_lost, in_place_of)
        self.closed = False  # its front is gone

    def _on_message(self, message: LinkMessage) -> None:
        kind = message[0]
        if kind == "infer":
            if self._infer_now(*message[1:]):
                return
            task = self._start(self._infer(*message[1:]))
            self._infers.add(task)
            task.add_done_callback(self._infers.discard)
        elif kind == "body":
            forwarded = self._forwarded.get(message[1])
            if forwarded is not None:
                forwarded.feed(message[2], message[3])
        elif kind == "http":
            rid = message[1]
            want = partial(self.link.send, ("want", rid))
            forwarded = self._forwarded[rid] = _Forwarded(want)
            self._start(self._http(forwarded, *message[1:]))
        elif kind == "cancel":  # its client left (or the front is stopping)
            forwarded = self._forwarded.get(message[1])
            if forwarded is not None:
                forwarded.leave()
            waiting = self._waiting.pop(message[1], None)
            if waiting is not None:  # a lane request: not run for nobody, nothing sent back
                cancel_for_departure(waiting)
            departure = self._departures.pop(message[1], None)
            if departure is not None:
                departure.left()
        elif kind == "listening":
            self._fronts.listening(message[1])

    def _start(self, work: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_lost(self) -> None:
        """The front is gone, and its connections with it: what it forwarded is left, and
        its infer requests are cancelled, as the drain cancels them in one process (their
        answers have nowhere to go, and a worker's call no request awaits is cut short
        when the engine stops)."""
        self.closed = True
        for forwarded in self._forwarded.values():
            forwarded.leave()
        for task in self._infers:
            task.cancel()
        for waiting in list(self._waiting.values()):
            waiting.cancel()

    def cut_off(self) -> None:
        """The gateway is stopping and the fronts have gone: what still runs for this
        front's clients (requests passed on to the app) is cancelled (Fronts.cut_off)."""
        for task in self._tasks:
            task.cancel()
        for waiting in list(self._waiting.values()):
            waiting.cancel()

    def running(self) -> list[asyncio.Task[None]]:
        return list(self._tasks)

    def _infer_now(
        self,
        rid: int,
        name: str,
        version: str | None,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        arrived: float,
        packed: Packed | None = None,
    ) -> bool:
        """`_infer` without a task, for the usual request (`InferRoute.answer_now`, as the
        lane does in one process): a task and its await chain cost the engine's loop, the
        limit with fronts, about a tenth of its CPU a request. False when the request
        needs `_infer` instead (nothing has been done then)."""
        if body is None or self._drain.refuses(arrived):
            return False
        respond = partial(self._answered, rid)
        try:
            decoded = None if packed is None else unpack(packed)
            answer = self._route.answer_now(name, version, headers, body, respond, decoded)
        except Exception:  # a bug: answered 500, never left hanging
            log.exception("infer %s failed outside its route", name)
            answer = internal_error()
        if answer is None:
            return False
        if isinstance(answer, Reply):
            respond(answer)
        else:
            self._waiting[rid] = answer
        return True

    def _answered(self, rid: int, reply: Reply | None) -> None:
        """`answer_now`'s answer, sent to the front (None: cancelled, the engine is
        stopping or the front has gone)."""
        if self._waiting.pop(rid, None) is None and (
            reply is None or reply.status == ClientGone.status
        ):
            return  # the front cancelled it: its client left
        if reply is None:
            headers, body = shutting_down(OUT_OF_TIME)
            self.link.send(("reply", rid, 503, headers, body, "-"))
        elif reply.outputs is not None:  # a 200 the front encodes
            self.link.send(("result", rid, reply.tenant, reply.outputs))
        else:
            self.link.send(("reply", rid, reply.status, reply.headers, reply.body, reply.tenant))

    async def _infer(
        self,
        rid: int,
        name: str,
        version: str | None,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        arrived: float,
        packed: Packed | None = None,  # `_infer_now`'s, not needed here
    ) -> None:
        if self._drain.refuses(arrived):  # its front's drain had not begun yet
            refused, content = shutting_down(NEW_REQUEST)
            self.link.send(("reply", rid, 503, refused, content, "-"))
            return

        async def receive() -> Message:
            if body is None:  # the client left before its body was whole
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}

        departure = self._departures[rid] = Departure()
        try:
            reply = await self._route.reply(
                name, version, headers, receive, body, departure=departure
            )
        finally:
            self._departures.pop(rid, None)
        try:
            if not departure.gone:
                self.link.send(
                    ("reply", rid, reply.status, reply.headers, reply.body, reply.tenant)
                )
        finally:
            reply.keeper.free_buffers()
        if reply.keeper.holding:
            await reply.keeper.release()

    async def _http(
        self,
        forwarded: _Forwarded,
        rid: int,
        method: str,
        path: str,
        raw_path: bytes,
        query_string: bytes,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
        http_version: str,
        arrived: float,
    ) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": http_version,
            "server": self._server,
            "client": tuple(client) if client else None,
            "scheme": "http",
            "method": method,
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query_string,
            "headers": headers,
            "state": {},
            ARRIVED_KEY: arrived,
            DEPARTURE_KEY: forwarded.departure,
        }
        started = ended = False

        async def send(message: Message) -> None:
            nonlocal started, ended
            if forwarded.gone:
                return  # as uvicorn drops what is sent to a client that left
            if message["type"] == "http.response.start":
                started = True
                response_headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
                self.link.send(("start", rid, message["status"], response_headers))
            elif message["type"] == "http.response.body":
                more = bool(message.get("more_body", False))
                ended = not more
                for i, (piece, further) in enumerate(pieces(message.get("body", b""), more)):
                    if i:  # the piece before goes out in a frame of its own first
                        await asyncio.sleep(0)
                    self.link.send(("chunk", rid, piece, further))
                    await self.link.drained()  # a front that does not keep up holds the app

        try:
            await self._app(scope, forwarded.receive, send)
        except Exception:
            log.exception("%s %s failed in the engine", method, path)
        finally:
            self._forwarded.pop(rid, None)
            if not ended and not started:  # as uvicorn answers an app that failed
                self.link.send(("start", rid, 500, [(b"content-type", b"text/plain")]))
                self.link.send(("chunk", rid, b"Internal Server Error", False))
            elif not ended:  # broke off mid-answer: the front closes the connection
                self.link.send(("abort", rid))


def pieces(body: bytes, more: bool, size: int = _PIECE) -> Iterator[tuple[bytes, bool]]:
    """A forwarded answer's body as the link carries it (marshal takes less than 2 GiB a
    piece): pieces of at most `size`, each with whether more of the answer follows."""
    if len(body) <= size:  # the usual answer: one piece, not copied again
        yield bytes(body), more
        return
    view = memoryview(body)
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size]), more or start + size < len(view)


def in_place_of(message: LinkMessage) -> LinkMessage | None:
    """What goes to a front in place of an answer the link cannot carry (a piece of 2 GiB
    or more: one tensor of an infer lane's answer): a 500 that says so; a forwarded
    answer's piece is split before, and one that is not goes as the answer breaking off."""
    kind, rid = message[0], message[1]
    if kind == "reply" or kind == "result":
        tenant = message[5] if kind == "reply" else message[2]
        body = error_body(
            "the answer is too large to pass from the engine to its front process (a tensor "
            "of 2 GiB or more). Hint: ask for fewer rows, or serve it without [server] fronts"
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        return ("reply", rid, 500, headers, body, tenant)
    if kind == "chunk" or kind == "start":
        return ("abort", rid)
    return None
