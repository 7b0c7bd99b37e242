"""/admin routes for tenants and breakers, and the admin-key guard for /admin and the
repository API. Changes go through the ProfileStore, so they persist atomically."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from tomlkit import TOMLDocument, table

from infergate.engine.breaker import TUNABLE
from infergate.engine.engine import Engine
from infergate.engine.tenants import SETTABLE, TenantState, hash_key, new_key
from infergate.errors import BadRequest, Forbidden, ModelNotFound, Unauthorized
from infergate.profile_store import ProfileStore
from infergate.server.codec import json_object
from infergate.server.infer_route import api_key

TENANT_FIELDS = set(SETTABLE)
BREAKER_FIELDS = set(TUNABLE)


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def admin_guard(engine: Engine) -> Any:
    async def guard(request: Request) -> None:
        headers = {k.lower(): v for k, v in request.headers.raw}
        key = api_key(headers)
        if engine.context.tenants.is_admin(key):
            return
        if key is None:
            raise Unauthorized(
                "this endpoint needs the admin key (Authorization: Bearer "
                "<key>). Hint: set INFERGATE_ADMIN_TOKEN for the CLI"
            )
        raise Forbidden(
            "this key is not an admin key; /admin and the repository API need "
            "one of server.admin_keys"
        )

    return Depends(guard)


def tenant_view(state: TenantState) -> dict[str, Any]:
    t = state.tenant
    return {
        "name": t.name,
        "class": t.cls,
        "rps": t.rps,
        "burst": t.burst,
        "max_concurrency": t.max_concurrency,
        "models": list(t.models),
        "devices": list(t.devices),
        "memory_mb": t.memory_mb,
        "keys": len(t.api_keys),
        "tokens": round(state.bucket.tokens, 2),
        "in_flight": state.concurrency.active,
        "admitted": state.admitted,
        "rate_limited": state.rate_limited,
        "over_concurrency": state.over_concurrency,
        "forbidden": state.forbidden,
    }


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return json_object(raw) if raw else {}


def _check_fields(doc: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise BadRequest(
            f"unknown {what} setting {unknown[0]!r}; known: {', '.join(sorted(allowed))}"
        )


def admin_router(engine: Engine, store: ProfileStore) -> APIRouter:
    router = APIRouter(dependencies=[admin_guard(engine)])
    tenants = engine.context.tenants

    @router.get("/admin/tenants")
    async def list_tenants() -> Response:
        return _json(
            {
                "tenants": [tenant_view(s) for s in tenants.states()],
                "profile": str(store.path),
                "profile_error": store.last_error,
            }
        )

    @router.post("/admin/tenants")
    async def add_tenant(request: Request) -> Response:
        doc = await _body(request)
        name = doc.pop("name", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise BadRequest("give the tenant a 'name' (letters, digits and _)")
        if any(s.tenant.name == name for s in tenants.states()):
            raise BadRequest(f"tenant {name!r} exists; use PATCH /admin/tenants/{name}")
        _check_fields(doc, TENANT_FIELDS, "tenant")
        key = new_key()

        def change(document: TOMLDocument) -> None:
            section = document.setdefault("tenants", table(is_super_table=True))
            entry = table()
            for k, v in doc.items():
                entry[k] = v
            entry["api_keys"] = [hash_key(key)]
            section[name] = entry

        await store.edit(change)
        return _json(
            {
                "name": name,
                "api_key": key,
                "note": "the key is shown once; only its hash is stored",
            },
            201,
        )

    @router.patch("/admin/tenants/{name}")
    async def set_tenant(name: str, request: Request) -> Response:
        doc = await _body(request)
        _check_fields(doc, TENANT_FIELDS, "tenant")
        if not any(s.tenant.name == name for s in tenants.states()):
            raise ModelNotFound(f"no tenant {name!r}. Hint: infergate tenant list")

        def change(document: TOMLDocument) -> None:
            section = document.setdefault("tenants", table(is_super_table=True))
            entry = section.setdefault(name, table())
            for k, v in doc.items():
                entry[k] = v

        await store.edit(change)
        return _json(tenant_view(tenants.get(name)))

    @router.delete("/admin/tenants/{name}")
    async def remove_tenant(name: str) -> Response:
        if not any(s.tenant.name == name for s in tenants.states()):
            raise ModelNotFound(f"no tenant {name!r}. Hint: infergate tenant list")

        def change(document: TOMLDocument) -> None:
            section = document.get("tenants", {})
            if name in section:
                del section[name]

        await store.edit(change)
        return _json({})

    @router.get("/admin/breakers")
    async def list_breakers() -> Response:
        rows = []
        for record in engine.models():
            for served in record.versions.values():
                b = served.breaker
                total, failed, p99 = b.window_stats()
                rows.append(
                    {
                        "model": served.name,
                        "version": served.version,
                        "state": b.state,
                        "reason": b.reason,
                        "retry_after_s": round(b.retry_after(), 2),
                        "window_requests": total,
                        "window_failures": failed,
                        "window_p99_ms": round(p99 * 1000, 1),
                        "policy": {k: getattr(b.policy, k) for k in sorted(BREAKER_FIELDS)},
                    }
                )
        return _json(rows)

    @router.patch("/admin/breakers/{model}")
    async def set_breaker(model: str, request: Request) -> Response:
        doc = await _body(request)
        _check_fields(doc, BREAKER_FIELDS, "breaker")
        engine.model(model)  # 404 for an unknown model

        def change(document: TOMLDocument) -> None:
            breaker = document.setdefault("breaker", table())
            models = breaker.setdefault("models", table(is_super_table=True))
            entry = models.setdefault(model, table())
            for k, v in doc.items():
                entry[k] = v

        await store.edit(change)
        return _json(
            {
                "model": model,
                "policy": {
                    k: getattr(engine.context.breaker_models[model], k)
                    for k in sorted(BREAKER_FIELDS)
                },
            }
        )

    @router.post("/admin/breakers/{model}/reset")
    async def reset_breaker(model: str) -> Response:
        record = engine.model(model)
        for served in record.versions.values():
            served.breaker.reset()
        return _json({})

    return router
