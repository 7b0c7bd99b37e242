"""Triton's statistics extension: GET /v2/models[/{m}[/versions/{v}]]/stats."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from fastapi.responses import Response

from infergate.engine.engine import Engine
from infergate.server.infer_request import version_number


def _stats(model_stats: list[dict[str, Any]]) -> Response:
    return Response(orjson.dumps({"model_stats": model_stats}), media_type="application/json")


def stats_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.get("/v2/models/stats")
    async def all_stats() -> Response:
        return _stats(engine.statistics())

    @router.get("/v2/models/{name}/stats")
    @router.get("/v2/models/{name}/versions/{version}/stats")
    async def model_stats(name: str, version: str | None = None) -> Response:
        return _stats(engine.statistics(name, version_number(version)))

    return router
