"""Triton's HTTP extensions, gathered for the app: model configuration, statistics and
shared memory routes; the extensions the server metadata lists; strict readiness."""

from __future__ import annotations

from infergate.engine.engine import Engine
from infergate.server.routes import Guard, Routes
from infergate.server.shared_memory import shared_memory_routes
from infergate.server.triton_config import config_routes
from infergate.server.triton_stats import stats_routes

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


def triton_routes(engine: Engine, guard: Guard) -> Routes:
    """Included before /v2/models/{name}, so /v2/models/stats is not read as a model."""
    routes = Routes()
    routes.include(stats_routes(engine))
    routes.include(config_routes(engine, guard))
    routes.include(shared_memory_routes(engine, guard))
    return routes


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
