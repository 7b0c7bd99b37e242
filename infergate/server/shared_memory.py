"""Triton's shared memory extensions: /v2/systemsharedmemory (POSIX regions the codec reads
inputs from and writes outputs to) and /v2/cudasharedmemory (which needs a GPU)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from infergate.engine.engine import Engine
from infergate.engine.triton.shared_memory import SYSTEM_SHM
from infergate.errors import BadRequest, shown
from infergate.server.codec import json_object
from infergate.server.routes import Guard, Routes, optional_param


def _json(doc: Any) -> Response:
    return Response(orjson.dumps(doc), media_type="application/json")


def shared_memory_routes(engine: Engine, guard: Guard) -> Routes:
    # Registering makes the gateway map memory a client names: the admin key guards it,
    # as it guards loading models (open when the profile sets no admin keys).
    routes = Routes(guard)

    @routes.get("/v2/systemsharedmemory/status", "/v2/systemsharedmemory/region/{region}/status")
    async def status(request: Request) -> Response:
        return _json(SYSTEM_SHM.status(optional_param(request, "region")))

    @routes.post("/v2/systemsharedmemory/region/{region}/register")
    async def register(request: Request) -> Response:
        doc = json_object(await request.body(), "a JSON object with key, offset and byte_size")
        SYSTEM_SHM.register(
            request.path_params["region"],
            doc.get("key"),
            doc.get("offset", 0),
            doc.get("byte_size"),
        )
        return _json({})

    @routes.post(
        "/v2/systemsharedmemory/unregister", "/v2/systemsharedmemory/region/{region}/unregister"
    )
    async def unregister(request: Request) -> Response:
        SYSTEM_SHM.unregister(optional_param(request, "region"))
        return _json({})

    def no_cuda() -> BadRequest:
        gpus = [d for d in engine.context.devices.devices() if d.kind == "gpu"]
        if not gpus:
            return BadRequest(
                "CUDA shared memory needs a GPU and this host has no GPU "
                f"(device backend: {engine.context.devices.name}). Hint: use system shared "
                "memory (/v2/systemsharedmemory) instead"
            )
        return BadRequest(
            "CUDA shared memory is not supported by infergate yet. Hint: use system shared "
            "memory (/v2/systemsharedmemory) instead"
        )

    # No CUDA region can exist, so status lists none and unregistering is a no-op, which
    # is what clients do before they start (Triton's examples unregister both kinds).
    @routes.get("/v2/cudasharedmemory/status")
    async def cuda_status(_: Request) -> Response:
        return _json([])

    @routes.get("/v2/cudasharedmemory/region/{region}/status")
    async def cuda_region_status(request: Request) -> Response:
        region = request.path_params["region"]
        raise BadRequest(
            f"CUDA shared memory region {shown(region)} is not registered: {no_cuda()}"
        )

    @routes.post(
        "/v2/cudasharedmemory/unregister", "/v2/cudasharedmemory/region/{region}/unregister"
    )
    async def cuda_unregister(_: Request) -> Response:
        return _json({})

    @routes.post("/v2/cudasharedmemory/region/{region}/register")
    async def cuda_register(_: Request) -> Response:
        raise no_cuda()

    return routes
