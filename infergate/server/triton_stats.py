"""Triton's statistics extension: GET /v2/models[/{m}[/versions/{v}]]/stats."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from infergate.engine.engine import Engine
from infergate.server.infer_request import version_number
from infergate.server.paced_render import PacedRender
from infergate.server.routes import Routes, optional_param


def _stats(model_stats: list[dict[str, Any]]) -> Response:
    return _json(orjson.dumps({"model_stats": model_stats}))


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def stats_routes(engine: Engine) -> Routes:
    routes = Routes()

    async def render_all() -> bytes:
        return orjson.dumps({"model_stats": engine.statistics()})

    # Every model's: open to any client unless models are private, and 12 ms with many
    # models, so paced as /metrics is (server/paced_render.py).
    every_model = PacedRender(render_all)

    @routes.get("/v2/models/stats")
    async def all_stats(_: Request) -> Response:
        return _json(await every_model.get())

    @routes.get("/v2/models/{name}/stats", "/v2/models/{name}/versions/{version}/stats")
    async def model_stats(request: Request) -> Response:
        name, version = request.path_params["name"], optional_param(request, "version")
        return _stats(engine.statistics(name, version_number(version)))

    return routes
