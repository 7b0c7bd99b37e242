"""Triton's statistics extension: GET /v2/models[/{m}[/versions/{v}]]/stats."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from infergate.engine.engine import Engine
from infergate.server.infer_request import version_number
from infergate.server.routes import Routes, optional_param


def _stats(model_stats: list[dict[str, Any]]) -> Response:
    return Response(orjson.dumps({"model_stats": model_stats}), media_type="application/json")


def stats_routes(engine: Engine) -> Routes:
    routes = Routes()

    @routes.get("/v2/models/stats")
    async def all_stats(_: Request) -> Response:
        return _stats(engine.statistics())

    @routes.get("/v2/models/{name}/stats", "/v2/models/{name}/versions/{version}/stats")
    async def model_stats(request: Request) -> Response:
        name, version = request.path_params["name"], optional_param(request, "version")
        return _stats(engine.statistics(name, version_number(version)))

    return routes
