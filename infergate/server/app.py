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
from infergate.errors import BadRequest
from infergate.profile import Profile
from infergate.profile_store import ProfileStore
from infergate.server.admin import admin_guard, admin_router, check_model_name
from infergate.server.decoding import BodyDecoder
from infergate.server.errors import error_response, install_error_handlers
from infergate.server.infer_route import InferRoute, version_number
from infergate.server.views import (
    model_metadata,
    model_status,
    refresh_gauges,
    repository_index,
    stats_snapshot,
)

EXTENSIONS = ["binary_tensor_data", "model_repository"]


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def create_app(
    engine: Engine, max_request_bytes: int, store: ProfileStore | None = None
) -> ASGIApp:
    store = store or ProfileStore(None, Profile(source=None), engine)
    decoder = BodyDecoder()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        store.start()
        decoder.start()
        try:
            yield
        finally:
            decoder.close()
            await store.stop()
            await engine.stop()

    app = FastAPI(
        title="infergate", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)
    guard = [admin_guard(engine)]

    @app.get("/v2/health/live")
    async def live() -> Response:
        return _json({"live": True})

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        if not engine.ready:
            return error_response(503, "the gateway is still loading its models", 1)
        return _json({"ready": True})

    @app.get("/v2")
    async def server_metadata() -> Response:
        return _json({"name": "infergate", "version": __version__, "extensions": EXTENSIONS})

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def metadata(name: str, version: str | None = None) -> Response:
        served = engine.version(name, version_number(version))
        return _json(model_metadata(served, engine.model(name)))

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None) -> Response:
        served = engine.version(name, version_number(version))
        if not served.ready:
            raise served.not_ready_error()
        return _json({"name": name, "version": str(served.version), "ready": True})

    @app.post("/v2/repository/index", dependencies=guard)
    async def index() -> Response:
        return _json(repository_index(engine.models()))

    @app.post("/v2/repository/models/{name}/load", dependencies=guard)
    async def load(name: str) -> Response:
        record = await engine.load(check_model_name(name))
        if record.problem or record.failures or record.state != "ready":
            serving = record.default_version()
            keeps = (
                f"; version {serving.version} keeps serving"
                if serving is not None and serving.ready
                else ""
            )
            raise BadRequest(f"failed to load {name!r}: {record.reason}{keeps}")
        return _json({})

    @app.post("/v2/repository/models/{name}/unload", dependencies=guard)
    async def unload(name: str) -> Response:
        await engine.unload(check_model_name(name))
        return _json({})

    @app.get("/admin/models", dependencies=guard)
    async def admin_models() -> Response:
        return _json([model_status(r) for r in engine.models()])

    @app.get("/admin/models/{name}", dependencies=guard)
    async def admin_model(name: str) -> Response:
        status = model_status(engine.model(check_model_name(name)))
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
        return _json(stats_snapshot(engine))

    @app.get("/metrics")
    async def metrics() -> Response:
        refresh_gauges(engine)
        return Response(
            generate_latest(engine.context.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    app.include_router(admin_router(engine, store))
    return InferRoute(engine, app, max_request_bytes, decoder)
