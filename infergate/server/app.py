"""The Starlette app: KServe V2 routes, the repository extension, /admin and /metrics.
Each route maps HTTP onto one engine call and back. Inference itself is answered by
InferRoute in front of this app (see infer_route.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp

from infergate import __version__
from infergate.engine.engine import Engine
from infergate.engine.lifecycle.readiness import not_ready_error
from infergate.engine.triton.shared_memory import SYSTEM_SHM
from infergate.errors import BadRequest, shown
from infergate.profile import Profile
from infergate.profile_store import ProfileStore
from infergate.server.access_log import AccessLog
from infergate.server.admin import admin_guard, admin_routes, check_model_name
from infergate.server.body_budget import BodyBudget
from infergate.server.codec import strings_limit
from infergate.server.decoding import BodyDecoder
from infergate.server.drain import Drain
from infergate.server.errors import error_handlers, error_response
from infergate.server.infer_request import version_number
from infergate.server.infer_route import InferRoute
from infergate.server.paced_render import PacedRender
from infergate.server.private_models import PrivateModels
from infergate.server.routes import Routes, optional_param
from infergate.server.triton import EXTENSIONS, strict_not_ready, triton_routes
from infergate.server.views import (
    device_sample,
    model_metadata,
    model_status,
    refresh_gauges,
    repository_index,
    stats_snapshot,
)


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def replay_count(raw: str) -> int:
    """/admin/events' `replay`: how many past events to send first (400 for another value)."""
    if not (raw.isascii() and raw.isdigit()):
        raise BadRequest(
            f"replay must be a whole number (0 or more) of past events to send first, not "
            f"{shown(raw)}"
        )
    # Past nine digits it is more than the events kept: all of them (and no int() of
    # thousands of digits, past Python's limit).
    return int(raw) if len(raw) <= 9 else 10**9


def create_app(
    engine: Engine,
    max_request_bytes: int,
    store: ProfileStore | None = None,
    drain: Drain | None = None,
) -> tuple[ASGIApp, InferRoute]:
    """The app, and its infer route (for the HTTP protocol's lane, server/infer_lane.py).
    With `drain`, the app drains on its signal inside the access log, so a drain's 503
    carries a request id and a log line as every other answer does."""
    store = store or ProfileStore(None, Profile(source=None), engine)
    decoder = BodyDecoder(max_strings=strings_limit(max_request_bytes))
    SYSTEM_SHM.max_input_bytes = max_request_bytes

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await engine.start()
        store.start()
        try:
            yield
        finally:
            SYSTEM_SHM.close_all()
            decoder.close()
            await store.stop()
            await engine.stop()

    guard = admin_guard(engine)
    strict_readiness = store.profile.server.strict_readiness  # [server]: read at start
    server_name = store.profile.server.server_name
    private = store.profile.server.private_models  # health names no model (private_models.py)
    routes = Routes()
    routes.include(triton_routes(engine, guard))

    @routes.get("/v2/health/live")
    async def live(_: Request) -> Response:
        return _json({"live": True})

    @routes.get("/v2/health/ready")
    async def ready(_: Request) -> Response:
        if not engine.ready:
            return error_response(503, "the gateway is still loading its models", 1)
        failing = engine.context.start_failing
        if failing:  # the machine, not a model, is at fault: say so, and that it retries
            why = next(iter(failing.values()))
            if private:  # (the reason names the model) an operator reads it in /admin/models
                why = "a worker process could not be started"
            return error_response(503, f"{why}; the gateway keeps retrying", 1)
        if problem := strict_not_ready(engine, strict_readiness):
            if private:
                problem = "strict readiness: a model failed to load (see /admin/models)"
            return error_response(503, problem)
        return _json({"ready": True})

    @routes.get("/v2")
    async def server_metadata(_: Request) -> Response:
        return _json({"name": server_name, "version": __version__, "extensions": EXTENSIONS})

    @routes.get("/v2/models/{name}", "/v2/models/{name}/versions/{version}")
    async def metadata(request: Request) -> Response:
        name, version = request.path_params["name"], optional_param(request, "version")
        view = engine.version_view(name, version_number(version))
        return _json(model_metadata(view, engine.model_view(name)))

    @routes.get("/v2/models/{name}/ready", "/v2/models/{name}/versions/{version}/ready")
    async def model_ready(request: Request) -> Response:
        name, version = request.path_params["name"], optional_param(request, "version")
        view = engine.version_view(name, version_number(version))
        if not view.ready:
            raise not_ready_error(view.name, view.version, view.state, view.reason)
        return _json({"name": name, "version": str(view.version), "ready": True})

    @routes.post("/v2/repository/index", guard=guard)
    async def index(_: Request) -> Response:
        return _json(repository_index(engine.model_views()))

    @routes.post("/v2/repository/models/{name}/unload", guard=guard)
    async def unload(request: Request) -> Response:
        await engine.unload(check_model_name(request.path_params["name"]))
        return _json({})

    @routes.get("/admin/models", guard=guard)
    async def admin_models(_: Request) -> Response:
        return _json([model_status(m) for m in engine.model_views()])

    @routes.get("/admin/models/{name}", guard=guard)
    async def admin_model(request: Request) -> Response:
        name = check_model_name(request.path_params["name"])
        status = model_status(engine.model_view(name))
        status["events"] = [e.to_json() for e in engine.context.events.recent(name)[-10:]]
        return _json(status)

    @routes.get("/admin/events", guard=guard)
    async def events(request: Request) -> Response:
        """Server-sent events: reloads, failures, restarts, as they happen."""
        replay = replay_count(request.query_params.get("replay", "0"))
        if request.method == "HEAD":  # the stream's headers; its body never ends
            return Response(media_type="text/event-stream")

        async def stream() -> AsyncIterator[bytes]:
            yield b": infergate events\n\n"
            async for event in engine.context.events.subscribe(replay):
                yield (
                    b"event: "
                    + event.kind.encode()
                    + b"\ndata: "
                    + orjson.dumps(event.to_json())
                    + b"\n\n"
                )

        return StreamingResponse(stream(), media_type="text/event-stream")

    @routes.get("/admin/stats", guard=guard)
    async def stats(_: Request) -> Response:
        return _json(stats_snapshot(engine, await device_sample(engine)))

    # The exposition is rendered on a thread of its own, and paced (server/paced_render.py):
    # on the loop a render (16-20 ms for a few hundred series) held every tenant's
    # requests, and /metrics is open to any client (four clients scraping in a loop:
    # another tenant's p50 0.7 -> 5.3 ms, p99 28 ms).
    renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ig-metrics")

    async def render_metrics() -> bytes:
        refresh_gauges(engine, await device_sample(engine))
        engine.context.metrics.bodies_held.set(bodies.held)
        engine.context.metrics.bodies_waiting.set(bodies.waiting)
        rendering = renderer.submit(generate_latest, engine.context.metrics.registry)
        return await asyncio.wrap_future(rendering)

    exposition = PacedRender(render_metrics)

    @routes.get("/metrics")
    async def metrics(_: Request) -> Response:
        return Response(await exposition.get(), media_type=CONTENT_TYPE_LATEST)

    routes.include(admin_routes(engine, store, guard))
    app = Starlette(routes=routes.routes, exception_handlers=error_handlers(), lifespan=lifespan)
    inner: ASGIApp = PrivateModels(engine, app) if store.profile.server.private_models else app
    bodies = BodyBudget(int(store.profile.server.max_bodies_mb * 2**20))
    # A wait for room ends in a 503 well before the client's body deadline (a 408).
    budget_wait_s = min(10.0, store.profile.server.body_timeout_s / 2)
    route = InferRoute(engine, inner, max_request_bytes, decoder, bodies, budget_wait_s)
    return AccessLog(route if drain is None else drain.wrap(route)), route
