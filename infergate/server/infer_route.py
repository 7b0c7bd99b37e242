"""POST /v2/models/{name}[/versions/{v}]/infer as a bare ASGI app.

Inference is the one route where serving overhead is the product: a framework's request
cycle (middleware stack, routing, response wrappers; FastAPI's dependency solving, when
the app was FastAPI) costs several hundred microseconds per call on a small machine, more
than the pipe to the worker. So this route reads the body, calls the engine and writes the
answer in raw ASGI, and every other route stays in the Starlette app (server/app.py),
which this app falls back to.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, cast

from starlette.types import ASGIApp, Receive, Scope, Send

from infergate.engine.admission.tenants import TenantState
from infergate.engine.engine import Engine, Running
from infergate.engine.inference import InferenceResult
from infergate.engine.lifecycle.served import ServedVersion
from infergate.engine.remote.served import RemoteServedVersion
from infergate.engine.triton.classification import classify_outputs
from infergate.errors import (
    BadRequest,
    ClientGone,
    CompressLater,
    InfergateError,
    LargeAnswer,
)
from infergate.metrics import Finished
from infergate.server.access_log import TENANT_KEY
from infergate.server.body import read_body
from infergate.server.body_budget import DEFAULT_MAX_BODIES_BYTES, BodyBudget
from infergate.server.codec import Body, DecodedRequest, decode_request, strings_limit
from infergate.server.compression import (
    MIN_BYTES,
    ON_LOOP_MAX_BYTES,
    accepted_coding,
    compress_response,
    encoded_as,
)
from infergate.server.decoding import (
    ALWAYS_INLINE,
    INLINE_MAX_BYTES,
    KEPT_NOTHING,
    BodyDecoder,
    Keeper,
)
from infergate.server.departure import DEPARTURE_KEY, Departure, is_departure, unless_gone
from infergate.server.encoding import encode_response, response_headers
from infergate.server.errors import error_body, error_response
from infergate.server.infer_request import (
    HEADER_LENGTH,
    api_key,
    header_text,
    inference_request,
    timeout_s,
    version_number,
)
from infergate.server.infer_waiting import Later, Waiting
from infergate.server.large_answers import encode_in_slices, finish
from infergate.server.predecode import PackedOutputs, pack_outputs
from infergate.server.remote_pass import pass_through
from infergate.server.reply import Reply, error_headers

log = logging.getLogger("infergate.server")

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]*))?/infer$")
# A 200 too large to finish on the loop (`InferRoute._finished`): its outputs to encode,
# or its headers and body to compress.
Unfinished = LargeAnswer | CompressLater


class InferRoute:
    """Answers infer requests itself; hands everything else to `fallback`."""

    def __init__(
        self,
        engine: Engine,
        fallback: ASGIApp,
        max_request_bytes: int,
        decoder: BodyDecoder | None = None,
        bodies: BodyBudget | None = None,
        budget_wait_s: float = 10.0,
    ) -> None:
        self._engine = engine
        self._fallback = fallback
        self._limit = max_request_bytes
        self._decoder = decoder or BodyDecoder(max_strings=strings_limit(max_request_bytes))
        self._bodies = bodies or BodyBudget(DEFAULT_MAX_BODIES_BYTES)
        self._budget_wait_s = budget_wait_s
        self._running: asyncio.AbstractEventLoop | None = None
        # Answers given in this step of the loop, counted at its end (`_count`).
        self._counts: list[Finished] = []
        self._finishing: set[asyncio.Task[None]] = set()  # `finish_later`'s (the loop's are weak)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            match = INFER_PATH.match(scope["path"])
            if match is not None:
                if scope["method"] == "POST":
                    name, version = match.groups()
                    await self._infer(name, version, scope, receive, send)
                else:  # as every other route's: a 405 that says what the path takes
                    path = scope["path"]
                    answer = error_response(405, f"{scope['method']} is not allowed on {path}")
                    answer.headers["Allow"] = "POST"
                    await answer(scope, receive, send)
                return
        await self._fallback(scope, receive, send)

    async def _infer(
        self, name: str, version: str | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        departure = scope.get(DEPARTURE_KEY)
        reply = await self.reply(name, version, scope["headers"], receive, departure=departure)
        scope[TENANT_KEY] = reply.tenant  # for the access log (server/access_log.py)
        try:
            await send(
                {"type": "http.response.start", "status": reply.status, "headers": reply.headers}
            )
            # (A large body is written after its head, not joined: http_protocol.py.)
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
        departure: Departure | None = None,
    ) -> Reply:
        """The whole answer to one infer request, errors included, counted in the metrics
        and statistics; the caller sends it, then lets go of `Reply.keeper`. Called by the
        ASGI route above and by the HTTP protocol's lane (server/infer_lane.py). `whole`:
        the body as it came, when the caller holds all of it already (the lane,
        usually); else, and whenever it must be inflated, it is read from `receive`.
        `departure`: the client's leaving, which ends the request with a 499 where it is
        (server/departure.py)."""
        context = self._engine.context
        started = context.clock.now()
        keeper = Keeper()
        state: TenantState | None = None
        large: Unfinished | None = None
        try:
            headers_in = dict(raw_headers)
            state = context.tenants.authenticate(api_key(headers_in, raw_headers))
            status = 200
            headers, body = await self._answer(
                name, version, headers_in, receive, whole, state, keeper, departure
            )
        except LargeAnswer as answer:  # encoded in slices, below
            large = answer.with_traceback(None)
        except Exception as exc:
            status, headers, body = self._failed(name, exc)
        if large is None:
            try:
                return self._reply(name, state, status, headers, body, started, raw_headers, keeper)
            except CompressLater as later:  # too large to compress on the loop
                large = later.with_traceback(None)
        return await self._finished(name, state, large, started, raw_headers, keeper)

    def answer_now(
        self,
        name: str,
        version: str | None,
        raw_headers: list[tuple[bytes, bytes]],
        whole: bytes,
        respond: Callable[[Reply | None], None],
        decoded: DecodedRequest | None = None,
        *,
        headers_in: dict[bytes, bytes] | None = None,
    ) -> Reply | asyncio.Future[Any] | None:
        """`reply` without a coroutine, for the lane's usual request (`whole`: its body,
        all here): a task and the await chain down to the scheduler's future were about a
        tenth of the gateway's CPU a small request. None when the request needs `reply`
        instead, and nothing has been done then: limits kept in Redis, a body to inflate
        or too large to decode on the loop, a remote model. Else the Reply when it is
        answered at once (a refusal, an error, a batch of zero rows), or the future its
        answer waits on: `respond` gets the Reply when that is done, or None when it
        was cancelled (the gateway is stopping). The same checks, limits, counting and
        answers as `reply`, from the same functions. `decoded`: `whole` decoded already
        (by a front process, server/predecode.py); `headers_in`: `raw_headers` as a dict,
        when the caller made it already (the lane)."""
        context = self._engine.context
        if headers_in is None:
            headers_in = dict(raw_headers)
        front_decoded = decoded is not None
        if (
            context.shared_limits is not None
            or not self._as_read(whole, headers_in)
            or (
                decoded is None
                and len(whole) > ALWAYS_INLINE  # (most: no header looked up here)
                and not self._decoder.inline(whole, header_text(headers_in, HEADER_LENGTH))
            )
        ):
            return None
        started = context.clock.now()
        state: TenantState | None = None
        try:
            state = context.tenants.authenticate(api_key(headers_in, raw_headers))
            served, number = self._served(name, version, state)
            if isinstance(served, RemoteServedVersion):
                return None
            self._engine.admit(state, name)
            try:
                if decoded is None:
                    decoded = decode_request(
                        whole,
                        header_text(headers_in, HEADER_LENGTH),
                        max_strings=self._decoder.max_strings,
                    )
                running = self._engine.begin_admitted(
                    inference_request(name, number, decoded), state, served
                )
            except BaseException:
                self._engine.leave(state)
                raise
            if isinstance(running, Running):
                waiting = running.waiting
                answer = Waiting(
                    self, name, running, decoded, served, state, started, raw_headers, respond
                )
                answer.front_encodes = front_decoded
                if isinstance(waiting, asyncio.Future):  # queued: the usual case under load
                    waiting.add_done_callback(answer)
                    return waiting
                # Its own batch (or a sequence's step), awaited in a task that answers it as
                # soon as it is done: no further turn of the loop for a lone client.
                coroutine = cast(Coroutine[Any, Any, Any], waiting)
                task = self.loop().create_task(answer.after(coroutine), name="infer-now")
                task.add_done_callback(partial(answer.unstarted, coroutine))
                return task
            self._engine.leave(state)
            status = 200
            headers, body = self._encoded(running, decoded, served)
        except LargeAnswer as large:
            return self.finish_later(respond, name, state, large, started, raw_headers)
        except Exception as exc:
            status, headers, body = self._failed(name, exc)
        try:
            return self._reply(
                name, state, status, headers, body, started, raw_headers, KEPT_NOTHING
            )
        except CompressLater as later:
            return self.finish_later(respond, name, state, later, started, raw_headers)

    def settled(self, waiting: Waiting, outcome: Any, error: BaseException | None) -> Reply | None:
        """The answer to an `answer_now` request whose wait is over, from what it gave
        (`outcome`) or raised (`error`), counted; None when it was cancelled (the gateway
        is stopping: the lane answers 503, and nothing is counted), a 499 when its client
        left (server/departure.py: counted, never sent). An error is answered,
        never raised here (its traceback would hold this frame, and the request's
        tensors, in a reference cycle), but for a 200 too large to finish on the loop
        (LargeAnswer, CompressLater), which `Waiting.answer` has a task finish."""
        engine, name, state = self._engine, waiting.name, waiting.state
        if error is not None:
            engine.fail(waiting.running, error)
            engine.leave(state)
            if is_departure(error):
                error = ClientGone()
            elif not isinstance(error, Exception):  # cancelled: the gateway is stopping
                return None
            status, headers, body = self._failed(name, error)
        else:
            try:
                try:
                    result = engine.finish(waiting.running, outcome)
                finally:
                    engine.leave(state)
                status = 200
                if waiting.front_encodes:
                    packed = pack_outputs(
                        result.model, result.version, result.outputs, waiting.decoded
                    )
                    if packed is not None:
                        return self._reply(
                            name, state, 200, [], b"", waiting.started, waiting.raw_headers,
                            KEPT_NOTHING, packed,
                        )  # fmt: skip
                headers, body = self._encoded(result, waiting.decoded, waiting.served)
            except LargeAnswer:
                raise  # for `Waiting.answer`, which has a task finish it
            except Exception as exc:
                status, headers, body = self._failed(name, exc)
        return self._reply(
            name, state, status, headers, body, waiting.started, waiting.raw_headers, KEPT_NOTHING
        )

    def _failed(self, name: str, exc: Exception) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The answer to a request that raised: its error, or 500 for a bug (which must
        not take the connection down silently)."""
        if isinstance(exc, InfergateError):
            return exc.status, error_headers(exc.retry_after_s), error_body(exc)
        log.error("infer %s failed", name, exc_info=exc)
        body = error_body(InfergateError(f"internal error: {type(exc).__name__}: {exc}"))
        return 500, error_headers(None), body

    def _reply(
        self,
        name: str,
        state: TenantState | None,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        started: float,
        raw_headers: list[tuple[bytes, bytes]],
        keeper: Keeper,
        outputs: PackedOutputs | None = None,
        compress: bool = True,
    ) -> Reply:
        """The answer as sent, counted (`outputs`: a 200 a front encodes). CompressLater,
        with nothing counted, when the body is too large to compress here (`_finished`
        compresses it; `compress`: False there)."""
        tenant = "-" if state is None else state.tenant.name
        # Bounded labels, and none that tells a tenant (through the open /metrics) whether
        # a model it may not use exists (one that served the request, it may).
        model = name
        if status != 200 and (
            (state is not None and not state.tenant.may_use(name))
            or not self._engine.registry.has(name)
        ):
            model = "unknown"
        now = self._engine.context.clock.now()
        if status == 200 and len(body) >= MIN_BYTES and compress:  # (most: too small to pay)
            body = compress_response(raw_headers, headers, body, status, ON_LOOP_MAX_BYTES)
        # Counted right after this step, once the caller has written the answer: a
        # lone client's next request does not wait for the counting (call_soon runs it
        # before the task of any request read after it takes a step, so a scrape that
        # follows, on any connection, sees it). One callback counts every answer of the
        # step (a batch's, under load), not one a request.
        counts = self._counts
        if not counts:
            self.loop().call_soon(self._count)
        counts.append((model, tenant, status, now - started, now))
        headers.append((b"content-length", b"%d" % len(body)))
        return Reply(status, headers, body, tenant, keeper, outputs)

    async def _finished(
        self,
        name: str,
        state: TenantState | None,
        unfinished: Unfinished,
        started: float,
        raw_headers: list[tuple[bytes, bytes]],
        keeper: Keeper,
    ) -> Reply:
        """`_reply` for a 200 too large to finish in one go on the event loop
        (server/large_answers.py): its outputs encoded in slices (LargeAnswer), or its
        body as it is (CompressLater); joined, and compressed when the client asked, on
        a thread."""
        status, coding = 200, None
        try:
            if isinstance(unfinished, LargeAnswer):
                pieces, json_length = await encode_in_slices(*unfinished.args)
                headers = response_headers(json_length)
            else:
                headers, body = unfinished.args
                pieces = [body]
                del body
            del unfinished  # (not held here while the pieces are joined)
            if sum(map(len, pieces)) >= MIN_BYTES:
                coding = accepted_coding(raw_headers)
            body = await finish(pieces, coding)
        except Exception as exc:  # (a BYTES output that is not UTF-8, as JSON: a 400)
            status, headers, body = self._failed(name, exc)
            coding = None
        if coding is not None:
            encoded_as(headers, coding)
        return self._reply(
            name, state, status, headers, body, started, raw_headers, keeper, compress=False
        )

    def finish_later(
        self,
        respond: Callable[[Reply | None], None],
        name: str,
        state: TenantState | None,
        unfinished: Unfinished,
        started: float,
        raw_headers: list[tuple[bytes, bytes]],
    ) -> asyncio.Task[None]:
        """`_finished` for an `answer_now` request, in a task that gives `respond` the
        Reply (None when cancelled: the gateway is stopping); the task, for the lane's
        drain to cancel. (Its traceback let go of: it would hold the frames it came from.)"""
        unfinished = unfinished.with_traceback(None)
        finishing = self._finished(name, state, unfinished, started, raw_headers, KEPT_NOTHING)
        later = Later(respond, finishing)
        task = self.loop().create_task(later.run(), name="infer-large")
        self._finishing.add(task)
        task.add_done_callback(later.done)
        task.add_done_callback(self._finishing.discard)
        return task

    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the route answers on, kept rather than asked for each request:
        in Python 3.11 `asyncio.get_running_loop()` is a getpid() system call (0.3 µs
        here). Asked again once that loop is closed (a test's next app on a new loop)."""
        loop = self._running
        if loop is None or loop.is_closed():
            loop = self._running = asyncio.get_running_loop()
        return loop

    def _count(self) -> None:
        """Count the answers `_reply` gave since the last call."""
        counts, self._counts = self._counts, []
        context = self._engine.context
        context.metrics.requests_done(counts)
        context.stats.record_all(counts)

    async def _answer(
        self,
        name: str,
        version: str | None,
        headers: dict[bytes, bytes],
        receive: Receive,
        whole: bytes | None,
        tenant: TenantState,
        keeper: Keeper,
        departure: Departure | None,
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        served, number = self._served(name, version, tenant)
        # Admission (rate, concurrency) before the body: a refused request is answered
        # without waiting for its upload or decoding it. With [cluster] the limits live
        # in Redis (a round trip); without, the check stays synchronous.
        shared = self._engine.context.shared_limits is not None
        ticket = await self._engine.admit_shared(tenant, name) if shared else None
        if ticket is None:
            self._engine.admit(tenant, name)
        budgeted = 0  # bytes of the body budget this request holds (body_budget.py)
        try:
            body: Body
            if whole is not None and self._as_read(whole, headers):
                body = whole
            else:
                budgeted = await self._bodies.room_for_body(
                    tenant.tenant.name, headers, self._limit, self._budget_wait_s
                )
                body = await read_body(headers, receive, self._limit)
                if budgeted:  # what it came to (a compressed or chunked one: far less)
                    budgeted = self._bodies.keep_only(tenant.tenant.name, budgeted, len(body))
                if departure is not None:  # whether its client left with it (departure.py)
                    await departure.look()
            if departure is not None and departure.gone:  # not decoded, not run: for nobody
                raise ClientGone()
            length = header_text(headers, HEADER_LENGTH)
            if isinstance(served, RemoteServedVersion):
                if len(body) > INLINE_MAX_BYTES:  # its mapping is let go of off the loop
                    keeper.keep_buffer(body)
                reading = self._decoder.pass_through_header(body, length, tenant.tenant.name)
                if len(body) > INLINE_MAX_BYTES:  # it may wait for the helper
                    doc = await unless_gone(departure, reading)
                else:
                    doc = await reading
                if doc is not None:  # no tensor decoded: the body goes on as it came
                    params = doc.get("parameters") or {}
                    if not isinstance(params, dict):
                        raise BadRequest("parameters must be a JSON object")
                    if departure is not None and departure.gone:
                        raise ClientGone()
                    # Cancelled upstream when its client leaves: the connection it held
                    # is closed (http1.py), not handed to the next request mid-answer.
                    return await unless_gone(
                        departure,
                        pass_through(
                            self._engine,
                            served,
                            body,
                            length,
                            header_text(headers, b"content-type"),
                            params.get("priority"),
                            timeout_s(params),
                            tenant,
                        ),
                    )
            if self._decoder.inline(body, length):  # most bodies: decoded here, no coroutine
                decoded = decode_request(body, length, max_strings=self._decoder.max_strings)
                if length is None:
                    # All JSON: its tensors are copies, so the body is let go of while the
                    # request waits for its batch. Held, a flood of large bodies whose
                    # clients had left held a megabyte each in the engine (fronts: 1.5 GB).
                    body = b""
            else:
                decoded = await unless_gone(
                    departure, self._decoder.decode(body, length, keeper, tenant.tenant.name)
                )
            if departure is not None and departure.gone:
                raise ClientGone()
            result = await unless_gone(
                departure,
                self._engine.infer_admitted(inference_request(name, number, decoded), tenant),
            )
        finally:
            if budgeted:
                self._bodies.give(tenant.tenant.name, budgeted)
            if ticket is None:
                self._engine.leave(tenant)
            else:
                await self._engine.leave_shared(ticket)
        return self._encoded(result, decoded, served)

    def _as_read(self, whole: bytes, headers: dict[bytes, bytes]) -> bool:
        """Whether a whole body, here already, is what `read_body` would read: nothing
        to inflate, within the limit (else read_body gives its 400 or 413)."""
        return len(whole) <= self._limit and b"content-encoding" not in headers

    def _served(
        self, name: str, version: str | None, tenant: TenantState
    ) -> tuple[ServedVersion | RemoteServedVersion, int | None]:
        """The version a request names, ready to serve it, and its number."""
        # The allow-list (403) before anything about the model (404, 424, 503), which
        # comes before the rate and concurrency limits (429); all before the body.
        self._engine.check_allowed(tenant, name)
        number = version_number(version) if version else None  # (most name none: no call)
        served = self._engine.version(name, number, tenant.tenant.may_use)
        if not served.ready:
            raise served.not_ready_error()
        return served, number

    def _encoded(
        self,
        result: InferenceResult,
        decoded: DecodedRequest,
        served: ServedVersion | RemoteServedVersion,
    ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The response's headers and body for a result."""
        outputs = result.outputs
        if decoded.output_parameters:  # classification asked for (rare)
            outputs = classify_outputs(
                outputs, decoded.output_parameters, served.batchable, served.file.path
            )
        content, json_length = encode_response(result.model, result.version, outputs, decoded)
        return response_headers(json_length), content
