"""The FastAPI app: KServe V2 routes, the repository extension, /admin and /metrics.
Each route maps HTTP onto one engine call and back. Inference itself is answered by
InferRoute in front of this app (see infer_route.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp

from infergate import __version__
from infergate.engine.engine import Engine
from infergate.engine.lifecycle.readiness import not_ready_error
from infergate.engine.triton.shared_memory import SYSTEM_SHM
from infergate.profile import Profile
from infergate.profile_store import ProfileStore
from infergate.server.access_log import AccessLog
from infergate.server.admin import admin_guard, admin_router, check_model_name
from infergate.server.decoding import BodyDecoder
from infergate.server.drain import Drain
from infergate.server.errors import error_response, install_error_handlers
from infergate.server.infer_request import version_number
from infergate.server.infer_route import InferRoute
from infergate.server.private_models import PrivateModels
from infergate.server.triton import EXTENSIONS, strict_not_ready, triton_router
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
    decoder = BodyDecoder()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        store.start()
        try:
            yield
        finally:
            SYSTEM_SHM.close_all()
            decoder.close()
            await store.stop()
            await engine.stop()

    app = FastAPI(
        title="infergate", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)
    guard = [admin_guard(engine)]
    strict_readiness = store.profile.server.strict_readiness  # [server]: read at start
    server_name = store.profile.server.server_name
    private = store.profile.server.private_models  # health names no model (private_models.py)
    app.include_router(triton_router(engine, guard))

    @app.get("/v2/health/live")
    async def live() -> Response:
        return _json({"live": True})

    @app.get("/v2/health/ready")
    async def ready() -> Response:
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

    @app.get("/v2")
    async def server_metadata() -> Response:
        return _json({"name": server_name, "version": __version__, "extensions": EXTENSIONS})

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def metadata(name: str, version: str | None = None) -> Response:
        view = engine.version_view(name, version_number(version))
        return _json(model_metadata(view, engine.model_view(name)))

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None) -> Response:
        view = engine.version_view(name, version_number(version))
        if not view.ready:
            raise not_ready_error(view.name, view.version, view.state, view.reason)
        return _json({"name": name, "version": str(view.version), "ready": True})

    @app.post("/v2/repository/index", dependencies=guard)
    async def index() -> Response:
        return _json(repository_index(engine.model_views()))

    @app.post("/v2/repository/models/{name}/unload", dependencies=guard)
    async def unload(name: str) -> Response:
        await engine.unload(check_model_name(name))
        return _json({})

    @app.get("/admin/models", dependencies=guard)
    async def admin_models() -> Response:
        return _json([model_status(m) for m in engine.model_views()])

    @app.get("/admin/models/{name}", dependencies=guard)
    async def admin_model(name: str) -> Response:
        status = model_status(engine.model_view(check_model_name(name)))
        status["events"] = [e.to_json() for e in engine.context.events.recent(name)[-10:]]
        return _json(status)

    @app.get("/admin/events", dependencies=guard)
    async def events(replay: int = 0) -> StreamingResponse:
        """Server-sent events: reloads, failures, restarts, as they happen."""

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

    @app.get("/admin/stats", dependencies=guard)
    async def stats() -> Response:
        return _json(stats_snapshot(engine, await device_sample(engine)))

    @app.get("/metrics")
    async def metrics() -> Response:
        refresh_gauges(engine, await device_sample(engine))
        return Response(
            generate_latest(engine.context.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    app.include_router(admin_router(engine, store))
    inner: ASGIApp = PrivateModels(engine, app) if store.profile.server.private_models else app
    route = InferRoute(engine, inner, max_request_bytes, decoder)
    return AccessLog(route if drain is None else drain.wrap(route)), route
