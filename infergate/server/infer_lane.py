"""The infer lane: small infer requests answered from the HTTP protocol itself, without
an ASGI cycle.

At thousands of small requests a second the gateway's one event loop is the limit, and
an ASGI request cycle (its scope, the receive and send messages, uvicorn's header checks,
the access log's and the drain's wrappers) was about a tenth of the CPU a tiny infer
request cost it (`benchmarks/http_cpu.py`: 97.8 → 87.2 µs per request). So the protocol
(server/http_protocol.py) hands a request to this lane when it is a POST to an infer path
whose body is small enough to arrive before uvicorn would pause reading (a Content-Length
of at most 64 KiB) and nothing about it needs the general cycle (no Expect: 100-continue,
no chunked body, no %-escaped path, no earlier request still answering on the
connection). It starts at the request's head, as the ASGI route does, so admission (401,
403, 404, 429) still comes before the body, and the drain counts the request from then;
it answers with the same `InferRoute.reply` the ASGI route uses (every check, limit,
metric and error the same), with the access log's request id and line, in one write.
Everything else (large or streamed bodies above all) takes the ASGI route as before.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from starlette.types import Message, Receive
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from infergate.server.access_log import log, log_request, request_id
from infergate.server.body_budget import SMALL_BODY
from infergate.server.departure import Departure, cancel_for_departure
from infergate.server.drain import NEW_REQUEST, OUT_OF_TIME, Drain, shutting_down
from infergate.server.infer_route import INFER_PATH
from infergate.server.one_write import JOIN_AT_MOST
from infergate.server.reply import Reply, internal_error

if TYPE_CHECKING:
    from infergate.server.http_protocol import GatewayHttpProtocol

# uvicorn's HIGH_WATER_LIMIT: a body up to this size never pauses the connection's reading
# (nor takes any of the body budget).
LANE_MAX_BODY = SMALL_BODY
_LENGTH_DIGITS = 8  # more (zeros first) cannot be a length the lane takes
# The infer path, without %-escapes (the ASGI route decodes them) or a "#": the infer
# path's own literal parts hold neither, so its names are where they would be. (One
# match, where two searches of the path for them and the match were three calls.) Matched
# on the whole URL: the names stop at a "?", and the path's end (`$`: its end, or a "\n"
# ending it) comes at the URL's end or before its query, so no split of the URL is made.
_LANE_PATH = re.compile(
    INFER_PATH.pattern.replace("[^/]", "[^/%#?]").replace("/infer$", r"/infer\n?(?:\?|\Z)")
)
_CLOSE = b"connection: close\r\n"
_CLOSE_HEADER = (b"connection", b"close")
# The name of a lane request's task: an unnamed task formats a name ("Task-123") of its
# own (Python 3.11).
_LANE_TASK = "infer-lane"
server_log = logging.getLogger("infergate.server")


class Answers(Protocol):
    """What answers the lane's requests: `InferRoute` in the gateway, `ForwardRoute` in a
    front process (server/front.py), which asks the engine's."""

    async def reply(
        self,
        name: str,
        version: str | None,
        raw_headers: list[tuple[bytes, bytes]],
        receive: Receive,
        whole: bytes | None = None,
        departure: Departure | None = None,
    ) -> Reply: ...

    def answer_now(
        self,
        name: str,
        version: str | None,
        raw_headers: list[tuple[bytes, bytes]],
        whole: bytes,
        respond: Callable[[Reply | None], None],
        *,
        headers_in: dict[bytes, bytes] | None = None,
    ) -> Reply | asyncio.Future[Any] | None: ...


class InferLane:
    """Answers the protocol's eligible infer requests (see the module docstring)."""

    def __init__(self, route: Answers, drain: Drain | None = None) -> None:
        self.route = route
        self.drain = drain

    def take(self, protocol: GatewayHttpProtocol, keep_alive: bool) -> LaneCycle | None:
        """The cycle for the request whose head `protocol` just parsed, when this lane may
        take it (its method, Expect and Upgrade are the protocol's to check), else None."""
        match = _LANE_PATH.match(protocol.url.decode("latin-1"))
        if match is None:  # not an infer path, or one with escapes (or a "#")
            return None
        # The headers by name, made once for the request (the route reads them so too):
        # the last of a name sent twice, as a loop over them would find.
        headers_in = dict(protocol.headers)
        length = headers_in.get(b"content-length")
        if (
            length is None
            or b"transfer-encoding" in headers_in
            or len(length) > _LENGTH_DIGITS  # zeros first: the ASGI route's to refuse
            or not length.isdigit()
            or int(length) > LANE_MAX_BODY
        ):
            return None
        return LaneCycle(protocol, self, match, headers_in, keep_alive)


class _Done:
    """A cycle's `message_event` while nothing waits on it: before `start`, and once
    finished."""

    def set(self) -> None:
        pass


_DONE = _Done()


class LaneCycle:
    """One request on the lane. It stands in the protocol's `cycle` slot with the
    attributes uvicorn's protocol and ours read and write there (body, more_body,
    message_event, response_started, response_complete, disconnected, keep_alive), so
    the connection's limits, deadlines, pipelining and shutdown work on it unchanged."""

    __slots__ = (
        "protocol",
        "lane",
        "name",
        "version",
        "url",
        "headers",
        "headers_in",
        "keep_alive",
        "body",
        "more_body",
        "message_event",
        "response_started",
        "response_complete",
        "disconnected",
        "_waiter",
        "_rid",
        "_started",
        "_waiting",
    )

    def __init__(
        self,
        protocol: GatewayHttpProtocol,
        lane: InferLane,
        match: re.Match[str],
        headers_in: dict[bytes, bytes],
        keep_alive: bool,
    ) -> None:
        # Let go of when the run ends (`run`): the protocol holds this cycle, and a cycle
        # back to it would leave a closed connection to the cyclic garbage collector.
        self.protocol: GatewayHttpProtocol | None = protocol
        self.lane = lane
        self.name, self.version = match.groups()
        self.url = protocol.url
        self.headers: list[tuple[bytes, bytes]] = protocol.headers
        self.headers_in = headers_in  # the same, by name
        self.keep_alive = keep_alive
        self.body = bytearray()  # `+=` by the protocol's on_body, piece by piece
        self.more_body = True
        # The protocol calls `message_event.set()` on each piece of body, at its end and
        # on a disconnect; the cycle is its own event (see `set`) from `start` on, when
        # something may wait on it (a call a piece fewer before: most bodies are whole).
        self.message_event: LaneCycle | _Done = _DONE
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self._waiter: asyncio.Future[None] | None = None
        # (`_rid` and `_started`: set by `start` before anything reads them)
        self._waiting: asyncio.Future[Any] | None = None  # what `answer_now` waits on

    def start(self) -> None:
        """Answer the request; the protocol calls this right after the data that held its
        head (by then usually its whole body too). The usual request is answered without
        a task of its own (`InferRoute.answer_now`): a task and the await chain down to
        the scheduler's future cost about a tenth of the gateway's CPU a small request
        (`benchmarks/http_cpu.py`). Anything else runs `run` in a task, as before."""
        protocol = self.protocol
        assert protocol is not None, "started after the run ended"
        drain = self.lane.drain
        if protocol.transport.is_closing():  # its client left with the request sent
            self.disconnected = True  # (connection_lost comes in the loop's next step)
            rid = request_id(self.headers, self.headers_in)
            self._end(False, 499, "-", rid, time.perf_counter())
            return
        if not (self.more_body or self.disconnected) and (drain is None or not drain.draining):
            self._started = time.perf_counter()
            self._rid = request_id(self.headers, self.headers_in)
            try:
                answer = self.lane.route.answer_now(
                    self.name,
                    self.version,
                    self.headers,
                    bytes(self.body),
                    self._respond,
                    headers_in=self.headers_in,
                )
            except Exception:  # a bug: answered 500 (as `run` does), never left hanging
                server_log.exception("infer %s failed outside its route", self.name)
                answer = internal_error()
            if answer is not None:
                if drain is not None:
                    drain.in_flight += 1
                if isinstance(answer, Reply):
                    self._respond(answer)
                else:  # the drain's end cancels it as it cancels the server's tasks
                    self._waiting = answer
                    self.message_event = self  # a disconnect cancels it (`set`)
                    protocol.tasks.add(answer)  # type: ignore[arg-type]
                return
        self.message_event = self  # the rest of the body wakes `_receive` (`set`)
        task = asyncio.Task(self.run(), loop=protocol.loop, name=_LANE_TASK)
        task.add_done_callback(protocol.tasks.discard)
        protocol.tasks.add(task)

    def _respond(self, reply: Reply | None) -> None:
        """`answer_now`'s answer, written (None: cancelled, the gateway is stopping)."""
        protocol = self.protocol
        if protocol is not None and self._waiting is not None:
            protocol.tasks.discard(self._waiting)
        self._waiting = None
        if reply is None:  # cancelled: its client left (`set`), or the gateway is stopping
            status, tenant = (499, "-") if self.disconnected else (503, "-")
            headers, body = shutting_down(OUT_OF_TIME)
        else:
            status, headers, body, tenant, _, _ = reply
        # The client reads slower than we answer (`_paused`, inline): wait in a task.
        if protocol is not None and protocol.flow.write_paused and not self.disconnected:
            task = asyncio.Task(
                self._send_late(status, headers, body, tenant), loop=protocol.loop, name=_LANE_TASK
            )
            task.add_done_callback(protocol.tasks.discard)
            protocol.tasks.add(task)
            return
        try:
            self._write(status, headers, body, self._rid)
        except Exception:
            status = self._cut_off()
        finally:
            self._end(True, status, tenant, self._rid, self._started)

    async def _send_late(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, tenant: str
    ) -> None:
        try:
            await self._send(status, headers, body, self._rid)
        except Exception:
            status = self._cut_off()
        finally:
            self._end(True, status, tenant, self._rid, self._started)

    def _cut_off(self) -> int:
        """A bug while the answer was being written: logged, and the connection goes (the
        gateway serves on); the status to log for it."""
        server_log.exception("infer %s failed outside its route", self.name)
        if self.protocol is not None:
            self.protocol.transport.close()
        return 500

    def set(self) -> None:
        """Wake `_receive` if it waits for the rest of the body (or for nothing more).
        On a disconnect, what `answer_now`'s answer waits on is cancelled: a request
        queued for nobody is not run (server/departure.py)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.disconnected and self._waiting is not None:
            cancel_for_departure(self._waiting)

    async def _receive(self) -> Message:
        """The whole body in one message: at most LANE_MAX_BODY bytes, which the protocol
        buffers without pausing; usually here with the head, so nothing is awaited."""
        while self.more_body and not self.disconnected:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        if self.disconnected:
            return {"type": "http.disconnect"}
        body = bytes(self.body)
        self.body = bytearray()
        return {"type": "http.request", "body": body, "more_body": False}

    async def run(self) -> None:
        """Answer the request; the protocol starts this at the end of its head."""
        started = time.perf_counter()
        rid = request_id(self.headers, self.headers_in)
        drain = self.lane.drain
        counted = drain is not None and not drain.draining
        status, tenant = 503, "-"
        try:
            if drain is not None and not counted:  # as Drain.wrap answers the ASGI route
                headers, body = shutting_down(NEW_REQUEST)
                await self._send(status, headers, body, rid)
                return
            if drain is not None:
                drain.in_flight += 1
            # Usually the whole body came with the head: handed over as it is, without
            # a receive message (the route still reads it, when it must be inflated).
            whole = None if self.more_body or self.disconnected else bytes(self.body)
            assert self.protocol is not None, "run after its end"
            departure = self.protocol.departure()
            reply = await self.lane.route.reply(
                self.name, self.version, self.headers, self._receive, whole, departure=departure
            )
            status, tenant = reply.status, reply.tenant
            try:
                if self._paused():
                    await self._writable()
                self._write(status, reply.headers, reply.body, rid)  # no coroutine: usual case
            finally:
                reply.keeper.free_buffers()
            if reply.keeper.holding:
                await reply.keeper.release()
        except asyncio.CancelledError:
            # The gateway is stopping (the drain time ran out, or a second signal): a
            # JSON 503 rather than a cut connection, as the drain answers the ASGI route.
            if not self.response_started:
                headers, body = shutting_down(OUT_OF_TIME)
                await self._send(503, headers, body, rid)
            raise
        except Exception:  # a bug: answered 500 (uvicorn's cycle would), never left hanging
            if self.response_started:
                status = self._cut_off()
            else:
                server_log.exception("infer %s failed outside its route", self.name)
                status = 500
                internal = internal_error()
                await self._send(500, internal.headers, internal.body, rid)
        finally:
            self._end(counted, status, tenant, rid, started)

    def _end(self, counted: bool, status: int, tenant: str, rid: bytes, started: float) -> None:
        """What every request's end does, however it was answered."""
        drain = self.lane.drain
        if counted and drain is not None:
            drain.in_flight -= 1
        if log.isEnabledFor(logging.INFO):
            self._log(status, tenant, rid, started)
        # Both references that would keep this cycle in a reference cycle (with its
        # protocol, and with itself) go: it is freed by its count, not left to the
        # rarely-run cyclic collector (cli/serve.py's _tune_gc).
        self.protocol = None
        self.message_event = _DONE

    async def _send(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, rid: bytes
    ) -> None:
        """`_write`, once the client has read what was written before (the rare answers:
        refusals while draining, errors; the usual one is written in `run`)."""
        if self._paused():
            await self._writable()
        self._write(status, headers, body, rid)

    def _paused(self) -> bool:
        """Whether the client reads slower than we answer (its socket buffer is full)."""
        protocol = self.protocol
        return protocol is not None and protocol.flow.write_paused and not self.disconnected

    async def _writable(self) -> None:
        assert self.protocol is not None, "sent after the run ended"
        await self.protocol.flow.drain()

    def _write(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, rid: bytes
    ) -> None:
        """The whole response in one write, then the connection's next request."""
        protocol = self.protocol
        assert protocol is not None, "sent after the run ended"
        self.response_started = True
        transport = protocol.transport
        if self.disconnected or transport.is_closing():
            self.response_complete = True
            return
        parts: list[bytes] = [STATUS_LINE[status]]
        for name, value in protocol.server_state.default_headers:  # Date
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"x-request-id: ", rid, b"\r\n")  # sane (access_log.request_id)
        if _CLOSE_HEADER in headers:
            self.keep_alive = False
        elif not self.keep_alive:
            parts.append(_CLOSE)
        if len(body) > JOIN_AT_MOST:  # its head first: a join would copy it on the loop
            parts.append(b"\r\n")
            transport.write(b"".join(parts))
            transport.write(body)
        else:
            parts += (b"\r\n", body)
            transport.write(b"".join(parts))
        self.response_complete = True
        if not self.keep_alive:
            transport.close()
        protocol.on_response_complete()

    def _log(self, status: int, tenant: str, rid: bytes, started: float) -> None:
        """The access log's line (`run` calls it only when the log is enabled for INFO)."""
        path = self.url.partition(b"?")[0].decode("latin-1")
        log_request("POST", path, status, time.perf_counter() - started, tenant, rid)
