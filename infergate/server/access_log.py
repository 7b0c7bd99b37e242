"""An access log and request ids, as a small ASGI middleware around the app; the infer
lane (server/infer_lane.py) uses `request_id` and `log_request` for the requests it
answers.

Every HTTP response carries `X-Request-ID`: the client's (when it sent a sane one) or a new
one. With the `infergate.access` logger at INFO (`infergate serve --access-log`), each
request is one line: method, path, status, latency, model, version, tenant, request id;
with --log-format json these are fields of their own. The tenant is the one the infer route
authenticated (it leaves it in the ASGI scope); other routes show "-".
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Awaitable, Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("infergate.access")
MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?")
SANE_ID = re.compile(rb"^[\w.:@/+=-]{1,128}$")  # printable, no spaces: safe in a log line
TENANT_KEY = "infergate.tenant"


# Ids need to be unique, not secret: 128 bits from a generator seeded from the OS's
# entropy once, at a fifth of uuid4's cost (a getrandom call and a UUID object each).
_RANDOM = random.Random()


def request_id(
    headers: Collection[tuple[bytes, bytes]], by_name: dict[bytes, bytes] | None = None
) -> bytes:
    """The client's X-Request-ID when it is sane (the first sane one), else a new one.
    `by_name`: `headers` as a dict, when made already: looked up when no name came twice."""
    if by_name is not None and len(by_name) == len(headers):
        value = by_name.get(b"x-request-id")
        if value is not None and SANE_ID.match(value):
            return bytes(value)
    else:
        for name, value in headers:
            if name == b"x-request-id" and SANE_ID.match(value):
                return bytes(value)
    return b"%032x" % _RANDOM.getrandbits(128)


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope["headers"])
        started = time.perf_counter()
        status = 0

        def send_with_id(message: Message) -> Awaitable[None]:
            # Not a coroutine of its own: send's is awaited directly (two fewer per request).
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            return send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if log.isEnabledFor(logging.INFO):
                seconds = time.perf_counter() - started
                tenant = scope.get(TENANT_KEY, "-")
                log_request(scope["method"], scope["path"], status, seconds, tenant, rid)


def log_request(
    method: str, path: str, status: int, seconds: float, tenant: str, rid: bytes
) -> None:
    """The access log's line for one request (when `log` is enabled for INFO)."""
    match = MODEL_PATH.match(path)
    model, version = (match.group(1), match.group(2) or "-") if match else ("-", "-")
    latency_ms = round(seconds * 1000, 3)
    rid_text = rid.decode()
    log.info(
        "%s %s %s %.2f ms model=%s version=%s tenant=%s request_id=%s",
        method,
        path,
        status,
        latency_ms,
        model,
        version,
        tenant,
        rid_text,
        extra={
            "method": method,
            "path": path,
            "status": status,
            "latency_ms": latency_ms,
            "model": model,
            "version": version,
            "tenant": tenant,
            "request_id": rid_text,
        },
    )
