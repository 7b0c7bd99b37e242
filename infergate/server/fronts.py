"""The engine's side of `[server] fronts = N`: `infergate serve` as one engine process
(the engine, its workers, the whole app) behind N front processes that do the HTTP
(server/front.py).

One gateway process is one event loop, and at thousands of small requests a second that
loop is the limit while other cores idle: HTTP parsing, the edge limits and the socket
writes are about half of its work per request. With fronts, that half runs in the
fronts, and the engine's loop does the rest: it answers each front's requests from its
link (`server/front_link.py`), the lane's through `InferRoute.answer_now` and every
other one through the app, as uvicorn would run it. The engine starts the fronts once its
lifespan has started (models loading), says where it listens once they all do, starts
again one that dies (`Fronts`), and on SIGTERM drains: its app refuses new requests (503)
as in one process, each front drains its own connections, and the engine stops once they
have gone.
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
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp
from uvicorn.lifespan.on import LifespanOn

from infergate.errors import FrontFailed
from infergate.server.drain import Drain
from infergate.server.front_link import FrontLink
from infergate.server.http_protocol import ConnectionLimits
from infergate.server.infer_route import InferRoute

log = logging.getLogger("infergate.server")

_RESTART_MAX_S = 10.0  # the longest wait before a front that keeps dying is started again
_STEADY_S = 30.0  # a front up this long has its restart delay reset
_LISTEN_TIMEOUT_S = 60.0  # a front not listening by then is killed (FrontFailed)
_SECOND_SIGNAL_GRACE_S = 3.0  # after a second signal: the fronts' 503s, then SIGKILL
_CUT_OFF_GRACE_S = 1.0  # what the fronts left running ends within it (uvicorn's, in one process)


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
        self._links: list[FrontLink] = []

    def listening(self, pid: int) -> None:
        waiter = self._listening.pop(pid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def start(self) -> None:
        """Start every front and return once each listens (FrontFailed if one exits
        first)."""
        loop = asyncio.get_running_loop()
        await loop.create_unix_server(self._link, self._link_path)
        await asyncio.gather(*(self._spawn(i) for i in range(self.count)))
        self._watchers = [loop.create_task(self._watch(i)) for i in range(self.count)]

    def _link(self) -> asyncio.Protocol:
        """A front's link, kept until its front has gone (`cut_off`)."""
        link = FrontLink(self)
        self._links = [kept for kept in self._links if not kept.closed]
        self._links.append(link)
        return link.link

    async def cut_off(self, grace_s: float) -> None:
        """Once the fronts have gone: cancel what the engine still runs for their clients
        (requests passed on to its app), as uvicorn cancels its tasks after the drain in
        one process, and wait up to `grace_s` for them to end. A model's call no request
        awaits any more is then cut short when the engine stops."""
        for link in self._links:
            link.cut_off()
        running = [task for link in self._links for task in link.running()]
        if running:
            await asyncio.wait(running, timeout=grace_s)

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
    per_client = limits.max_connections_per_client
    per_front = dataclasses.replace(
        limits,
        max_connections=max(1, limits.max_connections // count),
        # The kernel spreads one client's connections over the fronts too.
        max_connections_per_client=-(-per_client // count) if per_client else 0,
    )
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
            await fronts.cut_off(_CUT_OFF_GRACE_S)
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
