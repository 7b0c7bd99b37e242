"""Triton's shared memory extensions: /v2/systemsharedmemory (POSIX regions the codec reads
inputs from and writes outputs to) and /v2/cudasharedmemory (which needs a GPU)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from infergate.engine.engine import Engine
from infergate.engine.triton.shared_memory import SYSTEM_SHM
from infergate.errors import BadRequest, shown
from infergate.server.codec import json_object


def _json(doc: Any) -> Response:
    return Response(orjson.dumps(doc), media_type="application/json")


def shared_memory_router(engine: Engine, guard: list[Any]) -> APIRouter:
    # Registering makes the gateway map memory a client names: the admin key guards it,
    # as it guards loading models (open when the profile sets no admin keys).
    router = APIRouter(dependencies=guard)

    @router.get("/v2/systemsharedmemory/status")
    @router.get("/v2/systemsharedmemory/region/{region}/status")
    async def status(region: str | None = None) -> Response:
        return _json(SYSTEM_SHM.status(region))

    @router.post("/v2/systemsharedmemory/region/{region}/register")
    async def register(region: str, request: Request) -> Response:
        doc = json_object(await request.body(), "a JSON object with key, offset and byte_size")
        SYSTEM_SHM.register(region, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
        return _json({})

    @router.post("/v2/systemsharedmemory/unregister")
    @router.post("/v2/systemsharedmemory/region/{region}/unregister")
    async def unregister(region: str | None = None) -> Response:
        SYSTEM_SHM.unregister(region)
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
    @router.get("/v2/cudasharedmemory/status")
    async def cuda_status() -> Response:
        return _json([])

    @router.get("/v2/cudasharedmemory/region/{region}/status")
    async def cuda_region_status(region: str) -> Response:
        raise BadRequest(
            f"CUDA shared memory region {shown(region)} is not registered: {no_cuda()}"
        )

    @router.post("/v2/cudasharedmemory/unregister")
    @router.post("/v2/cudasharedmemory/region/{region}/unregister")
    async def cuda_unregister(region: str | None = None) -> Response:
        return _json({})

    @router.post("/v2/cudasharedmemory/region/{region}/register")
    async def cuda_register(region: str) -> Response:
        raise no_cuda()

    return router
