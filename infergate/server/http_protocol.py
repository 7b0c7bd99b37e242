"""uvicorn's httptools protocol, with the limits a public edge needs, sending each
response in one write (server/one_write.py).

Limits and deadlines (nginx's client_header_timeout, client_body_timeout,
large_client_header_buffers, keepalive_timeout and worker_connections, in one place):
a request head larger than `max_header_bytes` gets 431; a head not complete within
`header_timeout_s` of its first byte, or a body not complete within `body_timeout_s` of
its head, gets 408 and the connection is closed; an answer of which the client reads
nothing for `body_timeout_s` (nginx's send_timeout) is dropped, the connection cut (else
a client that never reads would hold the answer's memory, and its connection, for as
long as it keeps its socket open); a connection that sends nothing for
`keep_alive_timeout_s` (a new one included: uvicorn arms that timer only after a first
response) is closed; past `max_connections` open connections a new one is answered 503
(JSON, Retry-After) and closed at once, so its descriptor is free again and the
connections already open keep working. The head is counted as it arrives, before
httptools buffers it (it joins a header's pieces as they come: a 100 MB header would
cost 100 MB and quadratic copying): what of it was parsed, and the raw bytes of each read
that ends inside it, only its own (a read that ends inside a head may begin with whole
requests pipelined before it, which are not that head's).

Pipelining (HTTP/1.1: requests sent without waiting for answers) is answered in order, one
request at a time as uvicorn does, with at most `PIPELINE_DEPTH` requests parsed and queued
behind the one being answered. httptools parses all of a read at once, and uvicorn queued
every request in it (a cycle, its scope and headers: about 2.4 KB each), so 60 KB of small
requests held 4 MB per connection for as long as the client did not read. The request past
the depth is not taken: the last one taken answers with `Connection: close`, the rest of
what the client sends is dropped, and the connection is half-closed after that answer
(`_linger`); a client retries what was not answered on a new connection (RFC 9112 9.3.2).
A refusal (400, 408, 431) of a request pipelined behind answers still owed goes out after
them, so each answer stays the answer to its own request.

This subclasses uvicorn's private HttpToolsProtocol, so pyproject.toml pins uvicorn's
minor version; a new uvicorn is taken by reading its httptools_impl.py against this.

uvicorn writes a response's head and its body with two `transport.write` calls: two
system calls and two TCP segments per response, and the client wakes twice to read them.
At thousands of small inference responses a second that is a measurable share of the
gateway's CPU. So a response head is held back and sent together with the write that
follows it (the body, or its first chunk); a head with nothing after it in the same
event-loop step goes out at the end of that step.

Small infer requests (a POST to an infer path with a Content-Length of at most 64 KiB, see
server/infer_lane.py) are handed, at the end of their head, to the infer lane, which
answers them without an ASGI cycle; everything else takes uvicorn's cycle.

The deadlines (head, body, keep-alive) share one timer per connection, moved lazily: a
request sets and clears three deadlines, and arming and cancelling an event-loop timer for
each (uvicorn's keep-alive timer included) cost about 7 µs of the gateway's CPU per request.
Setting a deadline later than the armed timer only records it; when the timer fires before
the deadline it is armed again for the time left, so it fires about once per keep-alive
period of a busy connection, and every deadline still ends on time. A head's or a body's
deadline is set only when a read ends inside it (most requests come whole in one read).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import httptools
import orjson
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from infergate.server.body_framing import (
    DROP_AT_MOST,
    FRAMING_ALLOWANCE,
    FREE_PIECES,
    MIN_PIECE_BYTES,
    READ_CREDIT,
    framing_too_large,
    refused_app,
    rest_is_large,
    too_many_pieces,
)
from infergate.server.departure import DEPARTURE_KEY, Departure
from infergate.server.one_write import HeadWithBody
from infergate.server.read_gate import GatedFlowControl, ReadGate

if TYPE_CHECKING:  # (at run time the lane comes with its class: no engine import here)
    from infergate.server.infer_lane import InferLane


# Requests parsed and waiting behind the one being answered on a connection (pipelined).
# nginx and others answer a pipeline one request at a time too, and pipelining clients
# send a few; each waiting request holds about 2.4 KB (uvicorn's cycle, scope, headers), so
# 16 hold about 40 KB, less than the 64 KB head a connection may already hold.
PIPELINE_DEPTH = 16

# While a front's read gate holds, a due deadline is looked at again this much later.
_HELD_LOOK_AGAIN_S = 1.0


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may take; see the module docstring and the README."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 2048
    max_connections_per_client: int = 0  # from one client address; 0: no limit of its own


def error_message(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole response, written straight to the socket: the gateway's JSON error."""
    body = orjson.dumps({"error": message})
    head = [
        STATUS_LINE[status],
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n",
    ]
    if retry_after_s is not None:
        head.append(b"retry-after: %d\r\n" % retry_after_s)
    return b"".join([*head, b"\r\n", body])


# The raw head is the parsed one plus its framing (method, version, line ends): a few
# dozen bytes. The raw count only has to stop a head that never ends.
_FRAMING_SLACK = 256


_TIMER_SLACK_S = 0.001


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a head (its names lowercased) says a body follows."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" 0")):
            return True
    return False


def _client_gone(cycle: RequestResponseCycle) -> None:
    """The app, if it waits for the body, sees the client go: the answer it would make has
    nowhere to go (another answer is sent instead, and the connection ends)."""
    cycle.disconnected = True
    cycle.message_event.set()


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the answer is already chosen."""


class _ThenLinger:
    """The transport of the last request a connection takes (see `PIPELINE_DEPTH`): its
    answer says Connection: close, and its close half-closes the connection instead."""

    def __init__(self, protocol: GatewayHttpProtocol) -> None:
        self._protocol = protocol
        transport = protocol.transport
        self.write = transport.write
        self.is_closing = transport.is_closing

    def close(self) -> None:
        self._protocol._linger()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._protocol.transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    # Small infer requests answered without an ASGI cycle (server/infer_lane.py).
    lane: ClassVar[InferLane | None] = None
    # Head and body in one write; False only to measure its gain (benchmarks/http_protocol.py).
    one_write: ClassVar[bool] = True
    # A front's: every connection stops reading while its link to the engine is backed up.
    read_gate: ClassVar[ReadGate | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn types it as int; it is only ever given to loop.call_later.
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._in_head = False
        # As received: bounds what httptools buffers; -1: the head began in this read.
        self._head_bytes = 0
        self._header_bytes = 0  # as parsed (line and headers): the limit itself
        # Set, the connection takes no more requests: the answer to send once those taken
        # are answered, then close (b"": none, see `_linger`).
        self._refusal: bytes | None = None
        # Two deadlines, on loop.time(): the idle one (keep-alive: close quietly) and the
        # request's (head or body: 408, with `_late` saying what was late and its limit).
        self._idle_at: float | None = None
        self._late_at: float | None = None
        self._late: tuple[float, str] = (0.0, "")
        self._timer: asyncio.TimerHandle | None = None  # at `_timer_at`, before both
        self._timer_at = 0.0
        # While the client reads slower than it is answered (writing paused): the next
        # look at whether it reads (see `_look_unread`).
        self._unread: asyncio.TimerHandle | None = None
        self._departure: Departure | None = None  # made for the first request that asks
        # The body in progress: its pieces, its bytes, and the bytes read meanwhile
        # (server/body_framing.py).
        self._in_body = False
        self._body_pieces = self._body_data = self._body_raw = 0
        self._lingering = False  # closing after the last answer, FIN sent (see _linger)
        self._dropped = 0  # bytes dropped since

    def departure(self) -> Departure:
        """The client's leaving, for the requests on this connection that wait on work
        done only for them (server/departure.py)."""
        if self._departure is None:
            self._departure = Departure(self.transport.is_closing, self._listen)
        return self._departure

    def _listen(self) -> None:
        """Read the connection again (its request's body is all read): its end is seen,
        and what follows is parsed and held as a pipelined request is."""
        if self.flow is not None and not self.transport.is_closing():
            self.flow.resume_reading()

    @classmethod
    def with_limits(
        cls,
        limits: ConnectionLimits,
        lane: InferLane | None = None,
        read_gate: ReadGate | None = None,
    ) -> type[GatewayHttpProtocol]:
        # Each server's class counts its clients' connections apart.
        per_client: Counter[str] = Counter()
        return type(
            cls.__name__,
            (cls,),
            {"limits": limits, "lane": lane, "per_client": per_client, "read_gate": read_gate},
        )

    # Open connections by client address, when max_connections_per_client is set.
    per_client: ClassVar[Counter[str]] = Counter()
    _client: str | None = None  # the address this connection counts against

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.one_write:
            transport = HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[assignment]
        super().connection_made(transport)
        gate = self.read_gate
        if gate is not None:
            self.flow = GatedFlowControl(self.transport, gate)
            if gate.held:
                self.transport.pause_reading()
        if len(self.connections) > self.limits.max_connections:
            self._answer_and_close(
                error_message(
                    503,
                    f"the gateway has {self.limits.max_connections} connections open, its "
                    "limit; retry shortly. Hint: reuse connections (keep-alive), or raise "
                    "max_connections in the profile's [server] table",
                    1,
                )
            )
            return
        if self.limits.max_connections_per_client and self._over_client_cap(transport):
            return
        # uvicorn arms the idle timer only after a response: a connection that never
        # sends a byte would stay open (and hold a descriptor) for ever.
        self._set_idle()

    def _over_client_cap(self, transport: asyncio.Transport) -> bool:
        """Count this connection against its client's address; past the cap, answer 503 and
        close it: one client holding connections open (slowly sent heads, reconnected
        after each 408) cannot take every slot before any key is checked."""
        peer = transport.get_extra_info("peername")
        if not isinstance(peer, tuple) or not peer:
            return False  # a Unix socket: no address to count by
        client, cap = str(peer[0]), self.limits.max_connections_per_client
        if self.per_client[client] >= cap:
            self._answer_and_close(
                error_message(
                    503,
                    f"this client address has {cap} connections open, the gateway's limit "
                    "for one client; retry shortly. Hint: reuse connections (keep-alive), "
                    "or raise max_connections_per_client in the profile's [server] table",
                    1,
                )
            )
            return True
        self.per_client[client] += 1
        self._client = client
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client is not None:
            left = self.per_client[self._client] - 1
            if left:
                self.per_client[self._client] = left
            else:
                del self.per_client[self._client]
            self._client = None
        self._idle_at = self._late_at = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop_watching()
        super().connection_lost(exc)
        departure, self._departure = self._departure, None  # (it holds this protocol)
        if departure is not None:
            departure.left()

    # A client that reads slower than it is answered: the transport's buffer is past its
    # high-water mark (rare, so watched with a timer of its own, not on the hot path).
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread is None:
            self._look_unread(None)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None

    def _look_unread(self, before: int | None) -> None:
        """Cut the connection if the client read nothing since the last look, else look
        again in body_timeout_s (what it does not read stays in the gateway's memory)."""
        unsent = self.transport.get_write_buffer_size()
        if before is not None and unsent >= before:
            self._unread = None
            self.transport.abort()  # its buffer goes now; the app sees the client leave
            return
        self._unread = self.loop.call_later(self.limits.body_timeout_s, self._look_unread, unsent)

    # uvicorn's keep-alive timer, as a deadline on the connection's one timer.
    def _unset_keepalive_if_required(self) -> None:
        self._idle_at = None

    def on_response_complete(self) -> None:
        # uvicorn 0.54's body, copied (pyproject pins <0.55: re-read it on an upgrade), with
        # the idle deadline set on the shared timer instead of a keep-alive timer of its own.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_at = None
        cycle = self.cycle
        if (
            cycle is not None
            and cycle.more_body
            and cycle.response_complete  # (else a request pipelined behind this answer)
            and rest_is_large(self.headers, self._body_data)
        ):
            # Answered before its body ended (401, 429...), with much of it still to come:
            # not read to its end to keep the connection (body_framing.py).
            self._end_with_answers_owed()
            return
        self.flow.resume_reading()
        if self.pipeline:  # pipelined requests start now, in order
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._refusal:  # held back for the answers owed before it: those are out
            self._answer_and_close(self._refusal)
        else:
            self._set_idle()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None or self.transport.is_closing():
            if self._lingering:  # told that nothing more is read (FIN sent), and sending on
                self._dropped += len(data)
                if self._dropped > DROP_AT_MOST:
                    self.transport.close()
            return
        self._idle_at = None  # uvicorn's _unset_keepalive_if_required
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol is switched to (KServe V2 is plain HTTP: uvicorn runs with
            # ws="none"): the request was taken as any other, its Upgrade ignored (RFC 9110
            # 7.8 lets a server), and the connection ends with its answer, since what
            # follows would be in the other protocol. Switched to WebSocket, a connection
            # was never counted off its client (max_connections_per_client): three
            # upgrades locked that address out for good; each also logged two warnings.
            self._end_with_answers_owed()
            return
        except httptools.HttpParserError as exc:
            if self._refusal is None:
                self._refusal = error_message(400, f"malformed HTTP request: {exc}")
            if self._refusal:
                self._answer_and_close(self._refusal)
            else:  # it ends after the answers owed (_end_with_answers_owed): no deadline
                self._clear_deadline()
            return
        # A deadline is set only for a head or body that a read ends inside, at that read's
        # end (the same moment as its first byte's, or its head's end): the usual request,
        # whole in one read, arms, moves and clears none.
        if self._in_body:  # the read ended inside a body: all of it counts (body_framing.py)
            if self._late_at is None:  # its first such read
                self._set_deadline(self.limits.body_timeout_s, "the request body")
            raw = self._body_raw = self._body_raw + len(data)
            if raw > self._body_data + (self._body_data >> 2) + FRAMING_ALLOWANCE:
                self._refuse_body(framing_too_large(raw, self._body_data))
                return
        if self._in_head:  # the read ended inside a head (rare): count what is that head's
            if self._head_bytes < 0:  # it began in this read, maybe after whole requests
                self._set_deadline(
                    self.limits.header_timeout_s, "the request head (line and headers)"
                )
                self._head_bytes = self._header_bytes + self._line_in_progress(data)
            else:  # it began before: all of this read is the head's
                self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes + _FRAMING_SLACK:
                self._answer_and_close(self._too_large_head())

    def _line_in_progress(self, data: bytes) -> int:
        """The bytes of the head's line in progress at the read's end (httptools holds
        them unparsed): those after the read's last line end, once a header of this head
        is parsed (its line end is in this read, after the requests before it). Before
        that, where the head began in the read is unknown: its first header line is counted
        when parsed or from the next read (at most one read of a head goes uncounted)."""
        return len(data) - 1 - data.rfind(b"\n") if self.headers else 0

    def on_message_begin(self) -> None:
        # uvicorn 0.54's first three lines, copied (pinned <0.55: re-read them on an
        # upgrade); its ASGI scope is built in on_headers_complete, and only for a request
        # that takes the ASGI route: the infer lane never reads one, and building it (two
        # dicts and a copy of the app state) was a share of every lane request's cost.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._idle_at = None  # a request has begun: its head's deadline rules, not idling
        self._in_head = True
        self._head_bytes = -1  # (see data_received, which also sets the head's deadline)
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        # (uvicorn cannot read CONNECT's host:port; a path's "/" spares the call)
        if url[0] != 0x2F and self.parser.get_method() == b"CONNECT":
            self._refusal = error_message(
                400,
                "CONNECT is not served: infergate is not a proxy. Hint: send the "
                "request itself (POST /v2/models/NAME/infer) to the gateway's address",
            )
            raise _Refused
        self._header_bytes += len(url)  # counted inline, as a header is
        if self._header_bytes > self.limits.max_header_bytes:
            self._count(0)
        self.url += url  # uvicorn's

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted inline and uvicorn 0.54's three lines copied (pinned <0.55: re-read them
        # on an upgrade): a request has several headers, and a call per header costs.
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > self.limits.max_header_bytes:
            self._count(0)
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._body_pieces = self._body_data = 0
        self._body_raw = -READ_CREDIT  # (the read it begins in: see body_framing.py)
        upgrade = self.parser.should_upgrade()
        if upgrade and _declares_body(self.headers):
            # httptools reads no body after an Upgrade head: the request would see none
            # (curl --http2 on http:// sends Upgrade: h2c; a 100 Continue invited the body)
            self._refusal = error_message(
                400,
                "a request with an Upgrade header cannot carry a body here: infergate "
                "speaks HTTP/1.1 and upgrades to nothing. Hint: drop the Upgrade header "
                "(curl: --http1.1 instead of --http2)",
            )
            raise _Refused
        # The head's deadline, if it spanned reads, is over (`_clear_deadline`, inline: every
        # request); the body's is set where a read ends inside the body (data_received):
        # most bodies come whole with their head.
        self._late_at = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # else: pipelined, behind an answer
            lane = self.lane
            parser = self.parser
            if (
                lane is not None
                and parser.get_method() == b"POST"
                and not self.expect_100_continue
                and not upgrade
            ):
                keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
                lane_cycle = lane.take(self, keep_alive)
                if lane_cycle is not None:
                    # It has what uvicorn's protocol uses of a cycle.
                    self.cycle = lane_cycle  # type: ignore[assignment]
                    # Started once this data is parsed (its body, usually); what it waits
                    # on is one of the server's tasks, as uvicorn's own cycle: waited for
                    # on shutdown.
                    self.loop.call_soon(lane_cycle.start)
                    return
        elif len(self.pipeline) >= PIPELINE_DEPTH:
            self._take_no_more(cycle)
        self.scope = {  # uvicorn 0.54's on_message_begin builds it so; see that method
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        self.scope[DEPARTURE_KEY] = self.departure()  # type: ignore[literal-required]
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        pieces = self._body_pieces = self._body_pieces + 1
        data = self._body_data = self._body_data + len(body)
        if pieces > FREE_PIECES and data < pieces * MIN_PIECE_BYTES:
            self._refuse_body(too_many_pieces(pieces, data))
            raise _Refused  # the rest of this read is not parsed
        # uvicorn 0.54's on_body, copied (pinned <0.55: re-read it on an upgrade): one call
        # a piece, not two. Without its upgrade check: a request with an Upgrade header (or
        # a CONNECT) and a body is refused at its head (on_headers_complete).
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def _refuse_body(self, message: str) -> None:
        """A body that arrives at too high a cost (body_framing.py): a 400, unless it was
        answered already, then the lingering close (its answer is not lost to a reset)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self.pipeline and self.pipeline[0][0] is cycle:
                # Pipelined behind answers owed: its 400 takes its turn after them, and
                # ends the connection; nothing more is read.
                cycle.more_body = False
                cycle.keep_alive = False
                self.pipeline[0] = (cycle, refused_app(message))
                self._refusal = b""
                self._clear_deadline()
                return
            if cycle.response_started:  # an answer on its way cannot be replaced
                self._refusal = b""
                self.transport.close()
                return
            _client_gone(cycle)
            self.transport.write(error_message(400, message))
        self._clear_deadline()
        self._refusal = b""  # nothing more is read
        self._linger()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._late_at = None  # (`_clear_deadline`, inline: every request)
        cycle = self.cycle
        if cycle is None:  # an upgrade uvicorn took (with ws="none", never: no cycle)
            return
        if not cycle.response_complete:
            # uvicorn 0.54's on_message_complete, copied (pinned <0.55: re-read it on an
            # upgrade): one call, not two.
            if not (self.parser.should_upgrade() and self._should_upgrade()):
                cycle.more_body = False
                cycle.message_event.set()
        elif not self.pipeline:
            # Answered before its body ended (a refusal: 401, 404, 429): the connection is
            # idle from now, as after any answer (data_received cleared that deadline when
            # the rest of the body came), or nothing would ever close it.
            self._set_idle()

    def _take_no_more(self, last: RequestResponseCycle) -> NoReturn:
        """Past the pipelining depth: this request is not taken, and `last` (the newest
        queued, one of uvicorn's cycles) is the connection's last answer (see the module
        docstring). Raising stops httptools, which would parse the rest of the read."""
        last.keep_alive = False  # its answer says Connection: close, then closes...
        last.transport = _ThenLinger(self)  # type: ignore[assignment]  # ...by half-closing
        self._refusal = b""
        raise _Refused

    def _end_with_answers_owed(self) -> None:
        """Read nothing more; close once the requests taken are answered (at once if they
        are), the last answer saying Connection: close."""
        self._refusal = b""
        newest = self.pipeline[0][0] if self.pipeline else self.cycle
        if newest is None or newest.response_complete:
            self._linger()
            return
        newest.keep_alive = False
        newest.transport = _ThenLinger(self)  # type: ignore[assignment]

    def _linger(self) -> None:
        """Close after the last answer without losing it (RFC 9112 9.6, nginx's lingering
        close): the client may still be sending what is not taken, and a socket closed with
        bytes unread is reset, which can drop answers not yet delivered. So the FIN goes
        after the answers, what still comes is dropped (data_received), and the connection
        closes when the client closes it, or after keep_alive_timeout_s."""
        transport = self.transport
        if transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._lingering = True
        self.flow.resume_reading()
        self._set_idle()

    def send_400_response(self, msg: str) -> None:  # JSON, as every other error
        self._answer_and_close(error_message(400, f"malformed HTTP request: {msg}"))

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.limits.max_header_bytes:
            self._refusal = self._too_large_head()
            raise _Refused

    def _too_large_head(self) -> bytes:
        return error_message(
            431,
            f"the request head is over {self.limits.max_header_bytes} bytes, the limit. "
            "Hint: send large values in the body, or raise max_header_kb in the profile's "
            "[server] table",
        )

    def _set_idle(self) -> None:
        self._idle_at = at = self.loop.time() + self.timeout_keep_alive
        self._arm(at)

    def _set_deadline(self, seconds: float, what: str) -> None:
        self._late_at = at = self.loop.time() + seconds
        self._late = (seconds, what)
        self._arm(at)

    def _clear_deadline(self) -> None:
        self._late_at = None  # the timer, if armed, finds nothing due and lets it be

    def _arm(self, at: float) -> None:
        """Make sure the timer fires by `at`: a timer due sooner already does (see the
        module docstring)."""
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        # Timers keep whole milliseconds (uvloop's clock too): a deadline within one of
        # now is due, or the timer would spin on a remainder that rounds to zero.
        now = self.loop.time() + _TIMER_SLACK_S
        idle_at, late_at = self._idle_at, self._late_at
        gate = self.read_gate
        if gate is not None and gate.held:
            # A front reads nothing while its gate holds: what the client sent may be
            # waiting in its socket, so neither its silence nor its slowness is its own.
            # Due deadlines are looked at again shortly: once the gate opens, within a
            # second (a short hold buys a slow client no more than that).
            if idle_at is not None and idle_at <= now:
                self._idle_at = idle_at = now + _HELD_LOOK_AGAIN_S
            if late_at is not None and late_at <= now:
                self._late_at = late_at = now + _HELD_LOOK_AGAIN_S
        if idle_at is not None and idle_at <= now:
            self._idle_at = None
            self.timeout_keep_alive_handler()
        if late_at is not None and late_at <= now:
            self._late_at = None
            self._too_slow(*self._late)
        nearest = min((t for t in (self._idle_at, self._late_at) if t is not None), default=None)
        if nearest is not None and not self.transport.is_closing():
            self._arm(nearest)

    def _too_slow(self, seconds: float, what: str) -> None:
        cycle = self.cycle
        if cycle is not None and not self._in_head and cycle.response_started:
            self.transport.close()  # an answer is on its way; it cannot be replaced
            return
        self._answer_and_close(
            error_message(
                408,
                f"{what} did not arrive within {seconds:g} s; the connection is closed. "
                "Hint: send requests whole and promptly",
            )
        )

    def _answer_and_close(self, response: bytes) -> None:
        self._clear_deadline()
        self._unset_keepalive_if_required()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.more_body:
                # A whole request (pipelined ones too) is still being answered: this
                # refuses what came after it, so it goes after the answers owed
                # (on_response_complete), and nothing more is read.
                self._refusal = response
                return
            _client_gone(cycle)
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()
