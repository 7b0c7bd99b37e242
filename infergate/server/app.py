"""The FastAPI app: KServe V2 routes, the repository index, /admin. Each route maps HTTP
onto one engine call and back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp

from infergate import __version__
from infergate.engine.engine import Engine, ModelRecord
from infergate.engine.served import ServedVersion
from infergate.server.errors import error_response, install_error_handlers
from infergate.server.infer_route import InferRoute, version_number

EXTENSIONS = ["binary_tensor_data", "model_repository"]


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def model_metadata(served: ServedVersion, record: ModelRecord) -> dict[str, Any]:
    return {
        "name": served.name,
        "versions": [str(v) for v in sorted(record.versions)],
        "platform": served.platform,
        "inputs": [s.to_json() for s in served.inputs],
        "outputs": [s.to_json() for s in served.outputs],
        "parameters": {"state": served.state},
    }


def version_status(served: ServedVersion) -> dict[str, Any]:
    return {
        "version": served.version,
        "state": served.state,
        "reason": served.reason,
        "path": str(served.file.path),
        "platform": served.platform,
        "instances": [
            {
                "index": i.index,
                "state": i.state,
                "pid": i.pid,
                "restarts": i.restarts,
                "device": i.ready_info.device if i.ready_info else None,
                "reason": i.reason,
            }
            for i in served.instances
        ],
        "inputs": [s.to_json() for s in served.inputs],
        "outputs": [s.to_json() for s in served.outputs],
    }


def model_status(record: ModelRecord) -> dict[str, Any]:
    default = record.default_version()
    return {
        "name": record.name,
        "state": record.state,
        "reason": record.reason,
        "default_version": default.version if default else None,
        "versions": [version_status(record.versions[v]) for v in sorted(record.versions)],
    }


def create_app(engine: Engine, max_request_bytes: int) -> ASGIApp:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(
        title="infergate", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)

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

    @app.post("/v2/repository/index")
    async def repository_index() -> Response:
        rows = []
        for record in engine.models():
            if not record.versions:
                rows.append(
                    {"name": record.name, "state": "UNAVAILABLE", "reason": record.reason or ""}
                )
            for served in record.versions.values():
                rows.append(
                    {
                        "name": record.name,
                        "version": str(served.version),
                        "state": "READY" if served.ready else served.state.upper(),
                        "reason": served.reason or "",
                    }
                )
        return _json(rows)

    @app.get("/admin/models")
    async def admin_models() -> Response:
        return _json([model_status(r) for r in engine.models()])

    @app.get("/admin/models/{name}")
    async def admin_model(name: str) -> Response:
        return _json(model_status(engine.model(name)))

    return InferRoute(engine, app, max_request_bytes)
