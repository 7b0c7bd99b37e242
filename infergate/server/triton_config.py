"""Triton's model configuration extension: GET .../config, and the repository load with a
`parameters.config` override. Every load failure says "failed to load '<name>'", the
wording Triton's clients look for."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from infergate.engine.engine import Engine
from infergate.engine.repository.config_override import parse_override
from infergate.engine.snapshots import ModelView
from infergate.engine.triton.config import model_config
from infergate.errors import BadRequest, ModelNotFound
from infergate.server.admin import check_model_name
from infergate.server.codec import json_object
from infergate.server.infer_request import version_number
from infergate.server.routes import Guard, Routes, optional_param


def _json(doc: Any) -> Response:
    return Response(orjson.dumps(doc), media_type="application/json")


def _load_parameters(name: str, raw: bytes) -> dict[str, Any]:
    doc = json_object(raw) if raw.strip() else {}
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise BadRequest(f"failed to load {name!r}: 'parameters' must be an object")
    for key in params:
        if key != "config":
            raise BadRequest(
                f"failed to load {name!r}: load parameter {key!r} is not supported "
                "(only 'config' is). Hint: put model files in the repository folder"
            )
    return params


def _serving_platform(model: ModelView) -> str | None:
    """The platform of the version that serves `model` now, if one does."""
    for view in model.versions:
        if view.version == model.default_version:
            return view.platform
    return None


def config_routes(engine: Engine, guard: Guard) -> Routes:
    routes = Routes()

    @routes.get("/v2/models/{name}/config", "/v2/models/{name}/versions/{version}/config")
    async def config(request: Request) -> Response:
        name, version = request.path_params["name"], optional_param(request, "version")
        return _json(model_config(engine.version_view(name, version_number(version))))

    @routes.post("/v2/repository/models/{name}/load", guard=guard)
    async def load(request: Request) -> Response:
        # never a path outside the repository
        name = check_model_name(request.path_params["name"])
        params = _load_parameters(name, await request.body())
        override = None  # as in Triton: a plain load goes back to the files
        if "config" in params:
            platform = None
            if engine.registry.has(name):
                platform = _serving_platform(engine.model_view(name))
            override = parse_override(name, params["config"], platform)
        try:
            # Set and judged under the model's lock: each load with its own override.
            failed = await engine.load(name, override)
        except ModelNotFound as exc:
            raise BadRequest(f"failed to load {name!r}: {exc}") from None
        if failed is not None:
            raise BadRequest(f"failed to load {name!r}: {failed}")
        return _json({})

    return routes
