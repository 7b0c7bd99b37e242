"""POST /v2/models/{name}[/versions/{v}]/infer as a bare ASGI app.

Inference is the one route where serving overhead is the product: FastAPI's request
cycle (middleware stack, dependency solving, response wrappers) costs several hundred
microseconds per call on a small machine, more than the pipe to the worker. So this route
reads the body, calls the engine and writes the answer in raw ASGI, and every other route
stays in FastAPI, which this app falls back to.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, NamedTuple

from starlette.types import ASGIApp, Receive, Scope, Send

from infergate.engine.admission.tenants import TenantState
from infergate.engine.engine import Engine
from infergate.engine.inference import InferenceRequest
from infergate.engine.remote.served import RemoteServedVersion
from infergate.engine.scheduling.sequences import sequence_params
from infergate.engine.triton.classification import classify_outputs
from infergate.errors import BadRequest, InfergateError
from infergate.server.access_log import TENANT_KEY
from infergate.server.body import read_body
from infergate.server.codec import Body, DecodedRequest, decode_request, encode_response
from infergate.server.compression import compress_response
from infergate.server.decoding import INLINE_MAX_BYTES, BodyDecoder, Keeper
from infergate.server.errors import error_body, retry_after_header
from infergate.server.remote_pass import pass_through

log = logging.getLogger("infergate.server")

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]*))?/infer$")
_JSON = (b"content-type", b"application/json")
_BINARY = (b"content-type", b"application/octet-stream")


def version_number(version: str | None) -> int | None:
    if version is None or version == "":
        return None
    if not version.isdigit() or int(version) <= 0:
        raise BadRequest(f"model version must be a positive integer, got {version!r}")
    return int(version)


def timeout_s(parameters: dict[str, Any]) -> float | None:
    """tritonclient sends `timeout` in microseconds."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise BadRequest(
            f"parameters.timeout must be a positive number of microseconds, got {timeout!r}"
        )
    return float(timeout) / 1e6


def session_of(parameters: dict[str, Any]) -> str | None:
    session = parameters.get("session")
    if session is None:
        return None
    if not isinstance(session, (str, int)) or isinstance(session, bool):
        raise BadRequest(f"parameters.session must be a string, got {session!r}")
    return str(session)


HEADER_LENGTH = b"inference-header-content-length"


def header_text(headers: dict[bytes, bytes], name: bytes) -> str | None:
    """A header that must be ASCII text; 400 naming it when it is not."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(
            f"header {name.decode()} holds bytes that are not ASCII: {raw[:40]!r}"
        ) from None


def api_key(headers: dict[bytes, bytes]) -> str | None:
    """The caller's key from `Authorization: Bearer <key>` or `X-API-Key: <key>`."""
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, token = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key else None


class Reply(NamedTuple):
    """An infer request's answer, ready to send."""

    status: int
    headers: list[tuple[bytes, bytes]]  # Content-Length included
    body: bytes
    tenant: str  # the authenticated tenant's name, "-" before authentication
    keeper: Keeper  # what the request holds until its answer is sent


class InferRoute:
    """Answers infer requests itself; hands everything else to `fallback`."""

    def __init__(
        self,
        engine: Engine,
        fallback: ASGIApp,
        max_request_bytes: int,
        decoder: BodyDecoder | None = None,
    ) -> None:
        self._engine = engine
        self._fallback = fallback
        self._limit = max_request_bytes
        self._decoder = decoder or BodyDecoder()
        self._running: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.match(scope["path"])
            if match is not None:
                name, version = match.groups()
                await self._infer(name, version, scope, receive, send)
                return
        await self._fallback(scope, receive, send)

    async def _infer(
        self, name: str, version: str | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        reply = await self.reply(name, version, scope["headers"], receive)
        scope[TENANT_KEY] = reply.tenant  # for the access log (server/access_log.py)
        try:
            await send(
                {"type": "http.response.start", "status": reply.status, "headers": reply.headers}
            )
            await send({"type": "http.response.body", "body": reply.body})
        finally:
            reply.keeper.free_buffers()
        if reply.keeper.holding:
            await reply.keeper.release()

    async def reply(
        self,
        name: str,
        version: str | None,
        raw_headers: list[tuple[bytes, bytes]],
        receive: Receive,
        whole: bytes | None = None,
    ) -> Reply:
        """The whole answer to one infer request, errors included, counted in the metrics
        and statistics; the caller sends it, then lets go of `Reply.keeper`. Called by the
        ASGI route above and by the HTTP protocol's lane (server/infer_lane.py). `whole`:
        the body as it came, when the caller holds all of it already (the lane,
        usually); else, and whenever it must be inflated, it is read from `receive`."""
        tenant = "-"
        context = self._engine.context
        started = context.clock.now()
        keeper = Keeper()
        state: TenantState | None = None
        try:
            headers_in = dict(raw_headers)
            state = context.tenants.authenticate(api_key(headers_in))
            tenant = state.tenant.name
            status = 200
            headers, body = await self._answer(
                name, version, headers_in, receive, whole, state, keeper
            )
        except InfergateError as exc:
            status, headers, body = exc.status, error_headers(exc.retry_after_s), error_body(exc)
        except Exception as exc:  # a bug must not take the connection down silently
            log.exception("infer %s failed", name)
            status, headers = 500, error_headers(None)
            body = error_body(InfergateError(f"internal error: {type(exc).__name__}: {exc}"))
        # Bounded labels, and none that tells a tenant (through the open /metrics) whether
        # a model it may not use exists.
        allowed = state is None or state.tenant.may_use(name)
        model = name if allowed and self._engine.registry.has(name) else "unknown"
        now = context.clock.now()
        # Counted right after this task's step, once the caller has written the answer: a
        # lone client's next request does not wait for the counting (call_soon runs it
        # before the task of any request read after it takes a step, so a scrape that
        # follows, on any connection, sees it).
        self._loop().call_soon(self._count, model, tenant, status, now - started, now)
        body = compress_response(raw_headers, headers, body, status)
        headers.append((b"content-length", b"%d" % len(body)))
        return Reply(status, headers, body, tenant, keeper)

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the route answers on, kept rather than asked for each request:
        in Python 3.11 `asyncio.get_running_loop()` is a getpid() system call (0.3 µs
        here). Asked again once that loop is closed (a test's next app on a new loop)."""
        loop = self._running
        if loop is None or loop.is_closed():
            loop = self._running = asyncio.get_running_loop()
        return loop

    def _count(self, model: str, tenant: str, status: int, seconds: float, now: float) -> None:
        context = self._engine.context
        context.metrics.request_done(model, tenant, status, seconds)
        context.stats.record(model, status < 500, seconds, None if tenant == "-" else tenant, now)

    async def _answer(
        self,
        name: str,
        version: str | None,
        headers: dict[bytes, bytes],
        receive: Receive,
        whole: bytes | None,
        tenant: TenantState,
        keeper: Keeper,
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        # The allow-list (403) before anything about the model (404, 424, 503), which
        # comes before the rate and concurrency limits (429); all before the body.
        self._engine.check_allowed(tenant, name)
        number = version_number(version)
        served = self._engine.version(name, number, tenant.tenant.may_use)
        if not served.ready:
            raise served.not_ready_error()
        # Admission (rate, concurrency) before the body: a refused request is answered
        # without waiting for its upload or decoding it. With [cluster] the limits live
        # in Redis (a round trip); without, the check stays synchronous.
        shared = self._engine.context.shared_limits is not None
        ticket = await self._engine.admit_shared(tenant, name) if shared else None
        if ticket is None:
            self._engine.admit(tenant, name)
        try:
            body: Body
            if (
                whole is not None
                and len(whole) <= self._limit
                and b"content-encoding" not in headers
            ):
                body = whole  # here already, and nothing to inflate: read_body's answer
            else:
                body = await read_body(headers, receive, self._limit)
            length = header_text(headers, HEADER_LENGTH)
            if isinstance(served, RemoteServedVersion):
                if len(body) > INLINE_MAX_BYTES:  # its mapping is let go of off the loop
                    keeper.keep_buffer(body)
                doc = await self._decoder.pass_through_header(body, length)
                if doc is not None:  # no tensor decoded: the body goes on as it came
                    params = doc.get("parameters") or {}
                    if not isinstance(params, dict):
                        raise BadRequest("parameters must be a JSON object")
                    return await pass_through(
                        self._engine,
                        served,
                        body,
                        length,
                        header_text(headers, b"content-type"),
                        params.get("priority"),
                        timeout_s(params),
                        tenant,
                    )
            if self._decoder.inline(body):  # most bodies: decoded here, no coroutine
                decoded = decode_request(body, length)
            else:
                decoded = await self._decoder.decode(body, length, keeper)
            result = await self._engine.infer_admitted(
                inference_request(name, number, decoded), tenant
            )
        finally:
            if ticket is None:
                self._engine.leave(tenant)
            else:
                await self._engine.leave_shared(ticket)
        outputs = result.outputs
        if decoded.output_parameters:  # classification asked for (rare)
            outputs = classify_outputs(
                outputs, decoded.output_parameters, served.batchable, served.file.path
            )
        content, json_length = encode_response(result.model, result.version, outputs, decoded)
        if json_length is None:
            return [_JSON], content
        return [_BINARY, (b"inference-header-content-length", b"%d" % json_length)], content


def inference_request(name: str, number: int | None, decoded: DecodedRequest) -> InferenceRequest:
    params = decoded.parameters
    if not params:  # most requests: no timeout, priority, session or sequence to read
        return InferenceRequest(name, decoded.inputs, number, decoded.outputs)
    return InferenceRequest(
        model=name,
        version=number,
        inputs=decoded.inputs,
        outputs=decoded.outputs,
        timeout_s=timeout_s(params),
        priority=params.get("priority"),
        session=session_of(params),
        sequence=sequence_params(params),
    )


def error_headers(retry_after_s: float | None) -> list[tuple[bytes, bytes]]:
    headers = [_JSON]
    if retry_after_s is not None:
        headers.append((b"retry-after", retry_after_header(retry_after_s).encode()))
    return headers
