"""The engine's side of `[server] fronts = N`: `infergate serve` as one engine process
(the engine, its workers, the whole app) behind N front processes that do the HTTP
(server/front.py).

One gateway process is one event loop, and at thousands of small requests a second that
loop is the limit while other cores idle: HTTP parsing, the edge limits and the socket
writes are about half of its work per request. With fronts, that half runs in the
fronts, and the engine's loop does the rest: it answers each front's requests from its
link (`FrontLink`), the lane's through `InferRoute.reply` and every other one through the
app, as uvicorn would run it. The engine starts the fronts once its lifespan has started
(models loading), says where it listens once they all do, starts again one that dies
(`Fronts`), and on SIGTERM drains: its app refuses new requests (503) as in one process,
each front drains its own connections, and the engine stops once they have gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message
from uvicorn.lifespan.on import LifespanOn

from infergate.errors import FrontFailed
from infergate.server.drain import ARRIVED_KEY, NEW_REQUEST, OUT_OF_TIME, Drain, shutting_down
from infergate.server.errors import error_body
from infergate.server.http_protocol import ConnectionLimits
from infergate.server.infer_route import InferRoute, Reply, internal_error
from infergate.server.link import LinkProtocol
from infergate.server.link import Message as LinkMessage
from infergate.server.predecode import Packed, unpack

log = logging.getLogger("infergate.server")

_RESTART_MAX_S = 10.0  # the longest wait before a front that keeps dying is started again
_STEADY_S = 30.0  # a front up this long has its restart delay reset
_LISTEN_TIMEOUT_S = 60.0  # a front not listening by then is killed (FrontFailed)
_SECOND_SIGNAL_GRACE_S = 3.0  # after a second signal: the fronts' 503s, then SIGKILL
_PIECE = 64 << 20  # a forwarded answer's body goes to its front in pieces of at most this


class _Forwarded:
    """One forwarded request's body, as its pieces arrive, for the app's `receive`. The
    front sends none until the app first asks for it (`want`): a request the app refuses
    at its head (401, 403, 404, 429) costs its client no upload, and gets no `100
    Continue`, as in one process."""

    __slots__ = ("pieces", "gone", "_waiter", "_want")

    def __init__(self, want: Callable[[], None]) -> None:
        self.pieces: deque[tuple[bytes, bool]] = deque()
        self.gone = False
        self._waiter: asyncio.Future[None] | None = None
        self._want: Callable[[], None] | None = want

    def feed(self, body: bytes, more: bool) -> None:
        self.pieces.append((body, more))
        self._wake()

    def leave(self) -> None:
        self.gone = True
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
        # What the infer requests answered without a task wait on, by request id.
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.link = LinkProtocol(self._on_message, self._on_lost, in_place_of)

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
        elif kind == "cancel":
            forwarded = self._forwarded.get(message[1])
            if forwarded is not None:
                forwarded.leave()
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
        for forwarded in self._forwarded.values():
            forwarded.leave()
        for task in self._infers:
            task.cancel()
        for waiting in list(self._waiting.values()):
            waiting.cancel()

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
        self._waiting.pop(rid, None)
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

        reply = await self._route.reply(name, version, headers, receive, body)
        try:
            self.link.send(("reply", rid, reply.status, reply.headers, reply.body, reply.tenant))
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


def front_config(
    link: str,
    host: str,
    port: int,
    limits: ConnectionLimits,
    max_request_bytes: int,
    drain_timeout_s: float,
    log_level: str,
    log_format: str,
    access_log: bool,
) -> str:
    """What a front is started with (server/front.py's `main` reads it)."""
    return json.dumps(
        {
            "link": link,
            "host": host,
            "port": port,
            "limits": dataclasses.asdict(limits),
            "max_request_bytes": max_request_bytes,
            "keep_alive_s": limits.keep_alive_timeout_s,
            "drain_timeout_s": drain_timeout_s,
            "log_level": log_level,
            "log_format": log_format,
            "access_log": access_log,
        }
    )


class Fronts:
    """The front processes: started, watched, started again when one dies, stopped."""

    def __init__(
        self,
        count: int,
        app: ASGIApp,
        route: InferRoute,
        drain: Drain,
        server_address: tuple[str, int],
        config: str,
        link_path: str,
    ) -> None:
        self.count = count
        self.app = app
        self.route = route
        self.drain = drain
        self.server_address = server_address
        self._config = config
        self._link_path = link_path
        self._processes: list[asyncio.subprocess.Process | None] = [None] * count
        self._listening: dict[int, asyncio.Future[None]] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False

    def listening(self, pid: int) -> None:
        waiter = self._listening.pop(pid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def start(self) -> None:
        """Start every front and return once each listens (FrontFailed if one exits
        first)."""
        loop = asyncio.get_running_loop()
        await loop.create_unix_server(lambda: FrontLink(self).link, self._link_path)
        await asyncio.gather(*(self._spawn(i) for i in range(self.count)))
        self._watchers = [loop.create_task(self._watch(i)) for i in range(self.count)]

    async def _spawn(self, index: int) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "infergate.server.front",
            self._config,
            stdin=asyncio.subprocess.DEVNULL,
            # Its own session: a terminal's Ctrl-C reaches the engine alone, which drains
            # and then asks the fronts to (a front's own SIGINT and then the engine's
            # SIGTERM would be two signals to it: stop now).
            start_new_session=True,
        )
        self._processes[index] = process
        listening = asyncio.get_running_loop().create_future()
        self._listening[process.pid] = listening
        exited = asyncio.ensure_future(process.wait())
        await asyncio.wait(
            {listening, exited}, timeout=_LISTEN_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if not listening.done():
            self._listening.pop(process.pid, None)
            if process.returncode is None:  # neither listening nor gone: stuck
                process.kill()
                await process.wait()
            raise FrontFailed(
                f"front process {process.pid} exited ({process.returncode}) before it listened"
            )
        exited.cancel()

    async def _watch(self, index: int) -> None:
        delay = 0.5
        while True:
            process = self._processes[index]
            assert process is not None
            up_since = time.monotonic()
            code = await process.wait()
            if self._stopping:
                return
            if time.monotonic() - up_since > _STEADY_S:
                delay = 0.5
            log.warning(
                "front process %d exited (%s); starting another in %g s",
                process.pid,
                code,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(_RESTART_MAX_S, delay * 2)
            if self._stopping:
                return
            try:
                await self._spawn(index)
            except (FrontFailed, OSError) as exc:  # EAGAIN, EMFILE: try again, later
                log.warning("front process could not be started: %s", exc)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM each front (it drains its connections, server/drain.py) and wait for
        them; past `timeout_s`, SIGKILL what is left."""
        self._stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        alive = [p for p in self._processes if p is not None and p.returncode is None]
        self.send_signal(signal.SIGTERM)
        waiting = [asyncio.ensure_future(p.wait()) for p in alive]
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=timeout_s)
            if late:
                self.kill()
                await asyncio.wait(waiting)

    def send_signal(self, sig: signal.Signals) -> None:
        for process in self._processes:
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    def kill(self) -> None:
        self._stopping = True
        for process in self._processes:
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()


def serve_with_fronts(
    count: int,
    app: ASGIApp,
    route: InferRoute,
    drain: Drain,
    drain_timeout_s: float,
    sock: socket.socket,
    url: str,
    limits: ConnectionLimits,
    max_request_bytes: int,
    log_level: str,
    log_format: str,
    access_log: bool,
) -> int:
    """Run the engine behind `count` fronts until a signal has drained it; the exit code.
    `sock` holds the port (bound, never listening) until the gateway stops, so that no
    other program takes it while a front is being started again."""
    import uvloop

    host, port = sock.getsockname()[:2]
    folder = tempfile.mkdtemp(prefix="infergate-fronts-")  # mode 0700: only we reach the link
    link_path = str(Path(folder) / "link.sock")
    per_front = dataclasses.replace(limits, max_connections=max(1, limits.max_connections // count))
    config = front_config(
        link_path,
        host,
        port,
        per_front,
        max_request_bytes,
        drain_timeout_s,
        log_level,
        log_format,
        access_log,
    )
    fronts = Fronts(count, app, route, drain, (host, port), config, link_path)
    caught: list[signal.Signals] = []

    async def main() -> int:
        loop = asyncio.get_running_loop()
        signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        lifespan = LifespanOn(
            uvicorn.Config(app, lifespan="on", log_config=None, log_level=log_level)
        )
        await lifespan.startup()
        if lifespan.should_exit:
            return 1
        try:
            try:
                await fronts.start()
            except (FrontFailed, OSError) as exc:
                log.error("%s; the gateway stops", exc)
                fronts.kill()
                return 1
            log.info("listening on %s (%d front processes)", url, count)
            sig = await signals.get()
            caught.append(sig)
            drain.begin(drain_timeout_s)
            log.info(
                "%s: draining the fronts' requests for up to %g s; new ones get 503",
                signal.Signals(sig).name,
                drain_timeout_s,
            )
            stopping = loop.create_task(fronts.stop(drain_timeout_s + 2))
            second = loop.create_task(signals.get())
            await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
            if not stopping.done():  # a second signal: stop now (the fronts answer 503)
                fronts.send_signal(signal.SIGTERM)
                await asyncio.wait({stopping}, timeout=_SECOND_SIGNAL_GRACE_S)
                fronts.kill()
                await stopping
            second.cancel()
            return 0
        finally:
            await lifespan.shutdown()

    try:
        code = uvloop.run(main())
    finally:
        fronts.kill()
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    for sig in caught:  # end the way the signal asked, as uvicorn does
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return code
