"""Graceful shutdown: on SIGTERM (or a first Ctrl-C) the gateway stops taking requests and
lets the ones in flight finish, for up to `drain_timeout_s`, then stops.

While it drains, the listener stays open and every new request is answered 503 (JSON,
Retry-After, Connection: close) at once, as Envoy and nginx answer during a drain: a
load balancer or client retries elsewhere instead of finding a refused connection or a
reset. A request still running when the drain time is up is answered 503 JSON too, never
uvicorn's text/plain 500. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infergate.server.errors import error_body

log = logging.getLogger("infergate.server")

# A long-lived stream (the dashboard's event feed) is not a request to wait for.
NOT_WAITED_FOR = ("/admin/events",)
# Still answered while draining: the process is alive (a failing liveness probe would
# have Kubernetes kill it mid-drain) and its metrics are still worth a scrape. Readiness
# is not among them: it answers 503, so a load balancer stops sending first.
_SERVED_WHILE_DRAINING = ("/v2/health/live", "/metrics")


# With front processes (server/fronts.py), when a passed-on request reached its front
# (time.monotonic(), the same clock in every process): it arrived before the drain began
# and is served, as a request the one process had read is.
ARRIVED_KEY = "infergate.arrived"


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self.deadline = 0.0
        self.began = 0.0

    def begin(self, timeout_s: float) -> None:
        self.draining = True
        self.began = time.monotonic()
        self.deadline = self.began + timeout_s

    def refuses(self, arrived: float | None) -> bool:
        """Whether a request that reached a front at `arrived` (None: here, now) is a new
        one to refuse."""
        return self.draining and (arrived is None or arrived >= self.began)

    def done(self) -> bool:
        return self.in_flight == 0 or time.monotonic() >= self.deadline

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def drained(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            if self.refuses(scope.get(ARRIVED_KEY)) and scope["path"] not in _SERVED_WHILE_DRAINING:
                await _shutting_down(send, NEW_REQUEST)
                return
            if scope["path"] in NOT_WAITED_FOR or scope["path"] in _SERVED_WHILE_DRAINING:
                await app(scope, receive, send)
                return
            started = False

            async def tracking_send(message: Message) -> None:
                nonlocal started
                started = True
                await send(message)

            self.in_flight += 1
            try:
                await app(scope, receive, tracking_send)
            except asyncio.CancelledError:
                if not self.draining:
                    raise
                # The drain time ran out before this finished and uvicorn cancelled it:
                # answer it here (uvicorn's own answer is a text/plain 500) and end quietly.
                if not started:
                    await _shutting_down(send, OUT_OF_TIME)
            finally:
                self.in_flight -= 1

        return drained


NEW_REQUEST = "it is not taking new requests"
OUT_OF_TIME = "it could not finish this request in time"


def shutting_down(why: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The 503 of a drain (headers and body), saying `why`."""
    body = error_body(f"the gateway is shutting down: {why}. Hint: retry (another replica)")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    return headers, body


async def _shutting_down(send: Send, why: str) -> None:
    headers, body = shutting_down(why)
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining before it shuts down (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self.should_exit or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or before start: stop now
            return
        # uvicorn raises the signals it caught again once it has stopped, so the process
        # ends the way the signal asked (SIGTERM: terminated).
        self._captured_signals.append(sig)
        self.drain.begin(self.drain_timeout_s)
        log.info(
            "%s: draining %d request(s) for up to %g s; new ones get 503",
            signal.Signals(sig).name,
            self.drain.in_flight,
            self.drain_timeout_s,
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit and self.drain.done():
            self.should_exit = True
        return await super().on_tick(counter)
