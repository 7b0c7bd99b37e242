"""Triton's HTTP extensions, gathered for the app: model configuration, statistics and
shared memory routes; the extensions the server metadata lists; strict readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from infergate.engine.engine import Engine
from infergate.server.shared_memory import shared_memory_router
from infergate.server.triton_config import config_router
from infergate.server.triton_stats import stats_router

# As `GET /v2` lists them, in Triton's names (README: "Triton extensions").
EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "model_repository",
    "parameters",
    "sequence",
    "statistics",
    "system_shared_memory",
]


def triton_router(engine: Engine, guard: list[Any]) -> APIRouter:
    """Included before /v2/models/{name}, so /v2/models/stats is not read as a model."""
    router = APIRouter()
    router.include_router(stats_router(engine))
    router.include_router(config_router(engine, guard))
    router.include_router(shared_memory_router(engine, guard))
    return router


def strict_not_ready(engine: Engine, strict: bool) -> str | None:
    """Under strict readiness (Triton's default), why the server is not ready: a model that
    failed to load. None when ready, and always None when not strict."""
    if not strict:
        return None
    # Loading and restarting pass: they settle by themselves, a failed load does not.
    bad = [m for m in engine.model_views() if m.state in ("failed", "unavailable")]
    if not bad:
        return None
    names = ", ".join(f"{m.name} ({m.state})" for m in bad)
    return (
        f"strict readiness: these models failed to load: {names}. Hint: fix or unload them, or "
        "set strict_readiness = false under [server]"
    )
