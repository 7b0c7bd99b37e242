"""Triton's statistics extension: GET /v2/models[/{m}[/versions/{v}]]/stats."""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from fastapi.responses import Response

from infergate.engine.engine import Engine
from infergate.engine.lifecycle.served import ServedVersion
from infergate.server.infer_route import version_number


def _stats(versions: list[ServedVersion]) -> Response:
    doc = {
        "model_stats": [v.scheduler.stats.to_json(v.name, v.version) for v in versions],
    }
    return Response(orjson.dumps(doc), media_type="application/json")


def stats_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.get("/v2/models/stats")
    async def all_stats() -> Response:
        return _stats(
            [record.versions[v] for record in engine.models() for v in sorted(record.versions)]
        )

    @router.get("/v2/models/{name}/stats")
    @router.get("/v2/models/{name}/versions/{version}/stats")
    async def model_stats(name: str, version: str | None = None) -> Response:
        number = version_number(version)
        if number is not None:
            return _stats([engine.version(name, number)])
        record = engine.model(name)
        return _stats([record.versions[v] for v in sorted(record.versions)])

    return router
