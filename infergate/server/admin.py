"""/admin routes for tenants and breakers, and the admin-key guard for /admin and the
repository API. Changes go through the ProfileStore, so they persist atomically."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from tomlkit import TOMLDocument, table

from infergate.engine.admission.tenants import hash_key, new_key
from infergate.engine.engine import Engine
from infergate.engine.repository.scan import is_model_name
from infergate.engine.snapshots import TenantView
from infergate.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    PayloadTooLarge,
    TenantExists,
    TenantNotFound,
    Unauthorized,
)
from infergate.profile_store import ProfileStore
from infergate.server.body import read_body
from infergate.server.codec import json_object
from infergate.server.infer_request import api_key
from infergate.server.routes import Guard, Routes
from infergate.server.views import breaker_json, limit
from infergate.settings.edits import check_edit, editable

BREAKER_FIELDS = editable("breaker")


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


# What an HTML form (or a "simple" cross-origin fetch, which needs no CORS preflight) can
# send; no client of the admin API sends these.
_FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def check_model_name(name: str) -> str:
    """400 for a name that could not be a model in the repository: `..`, a path, hidden."""
    if not is_model_name(name):  # as the repository's scan names them
        raise BadRequest(
            f"{name!r} is not a model name: a model is a folder or file in the repository, "
            "named with letters, digits, '_', '-' and '.', not starting with '.'"
        )
    return name


def _same_origin(origin: bytes, host: bytes | None) -> bool:
    scheme, sep, rest = origin.decode("latin-1").strip().lower().partition("://")
    return (
        bool(sep)
        and scheme in ("http", "https")
        and host is not None
        and (rest.rstrip("/") == host.decode("latin-1").strip().lower())
    )


def _json_object_body(body: bytes) -> bool:
    return body.lstrip()[:1] == b"{"


_SHM_PATHS = ("/v2/systemsharedmemory/", "/v2/cudasharedmemory/")


def check_not_from_a_browser_page(
    method: str, headers: dict[bytes, bytes], body: bytes, path: str = ""
) -> None:
    """Refuse a state-changing request that a web page in the operator's browser could have
    sent: another site's `Origin`, or a body type a form can send. Without admin keys the
    admin API trusts anything that reaches it on loopback, and that includes pages the
    browser on the same machine opens.

    One exception: a form-encoded body that is a JSON object. A form percent-encodes `{`,
    so no HTML form sends one, while libcurl labels every POST body form-encoded unless
    told otherwise (perf_analyzer's shared-memory calls do exactly that); script from a
    page that could send it also sends its `Origin`, refused above. perf_analyzer also
    unregisters with an empty form-encoded body: allowed on the shared-memory routes only,
    where the worst an empty form could do is drop registrations, never a model."""
    if method in _SAFE_METHODS:
        return
    origin = headers.get(b"origin")
    if origin is not None and not _same_origin(origin, headers.get(b"host")):
        raise Forbidden(
            f"refused: this {method} comes from another site's page (Origin "
            f"{origin.decode('latin-1')!r}); browsers may not drive the admin API. Hint: "
            "call it from the CLI or a script, which send no Origin header"
        )
    kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1")
    if kind == "application/x-www-form-urlencoded" and (
        _json_object_body(body) or (not body.strip() and path.startswith(_SHM_PATHS))
    ):
        return
    if kind in _FORM_TYPES:
        raise Forbidden(
            f"refused: a {method} with Content-Type {kind} is what an HTML form sends, and "
            "browsers may not drive the admin API. Hint: send JSON (Content-Type: "
            "application/json) or no body"
        )


# /admin and repository-control bodies are small JSON documents (a tenant, a breaker
# policy, a load's config override, a shared-memory registration): max_request_mb, sized
# for tensors, is far too much to buffer for them.
ADMIN_BODY_BYTES = 1 << 20


def _admin_body_too_big() -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body is over the {ADMIN_BODY_BYTES >> 20} MB limit of /admin and "
        "repository requests (they take small JSON documents; max_request_mb is for "
        "inference). Hint: send only the JSON document the route takes"
    )


async def _small_body(request: Request, headers: dict[bytes, bytes]) -> bytes:
    """The body, read under ADMIN_BODY_BYTES (413 for a Content-Length over it before any
    is read, and a chunked body is cut where it passes it)."""
    try:
        body = await read_body(headers, request.receive, ADMIN_BODY_BYTES)
    except PayloadTooLarge:
        raise _admin_body_too_big() from None
    whole = bytes(body)  # (bytes already: read_body maps only bodies larger than this)
    # Starlette's Request.body() answers what it cached here: the endpoint's read.
    request._body = whole
    return whole


def _check_admin_key(engine: Engine, key: str | None) -> None:
    if engine.context.tenants.is_admin(key):
        return
    if key is None:
        raise Unauthorized(
            "this endpoint needs an admin key: send it as 'Authorization: Bearer <key>' "
            "(the CLI: --token or INFERGATE_ADMIN_TOKEN). Hint: the profile's "
            "server.admin_keys hold their hashes (infergate key new --admin)"
        )
    raise Forbidden(
        "this key is not an admin key; /admin and the repository API need one of server.admin_keys"
    )


def admin_guard(engine: Engine) -> Guard:
    async def guard(request: Request) -> None:
        raw = [(k.lower(), v) for k, v in request.headers.raw]
        headers = dict(raw)
        # The key first, from the headers alone: a caller without the admin key is refused
        # before any of its body is read (else a keyless 1 GB POST cost 1 GB for its 401).
        _check_admin_key(engine, api_key(headers, raw))
        body = b"" if request.method in _SAFE_METHODS else await _small_body(request, headers)
        check_not_from_a_browser_page(request.method, headers, body, request.url.path)

    return guard


def tenant_json(view: TenantView) -> dict[str, Any]:
    t = view.tenant
    return {
        "name": t.name,
        "class": t.cls,
        "rps": limit(t.rps),
        "burst": limit(t.burst),
        "max_concurrency": limit(t.max_concurrency),
        "models": list(t.models),
        "devices": list(t.devices),
        "memory_mb": t.memory_mb,
        "keys": len(t.api_keys),
        "tokens": limit(round(view.tokens, 2)),
        "in_flight": view.in_flight,
        "admitted": view.admitted,
        "rate_limited": view.rate_limited,
        "over_concurrency": view.over_concurrency,
        "forbidden": view.forbidden,
    }


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return json_object(raw) if raw else {}


def _check_fields(doc: dict[str, Any], what: str, prefix: str) -> None:
    """The profile's declarations name the keys and check the values (400 when refused);
    the edited file is read again in full before it replaces the old one."""
    try:
        check_edit(what, doc, prefix)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None


def _set(entry: Any, doc: dict[str, Any]) -> None:
    """Write `doc` into a profile table; a null removes the key (its default applies)."""
    for k, v in doc.items():
        if v is None:
            entry.pop(k, None)
        else:
            entry[k] = v


def admin_routes(engine: Engine, store: ProfileStore, guard: Guard) -> Routes:
    routes = Routes(guard)

    @routes.get("/admin/tenants")
    async def list_tenants(_: Request) -> Response:
        return _json(
            {
                "tenants": [tenant_json(v) for v in engine.tenant_views()],
                "profile": str(store.path),
                "profile_error": store.last_error,
            }
        )

    @routes.post("/admin/tenants")
    async def add_tenant(request: Request) -> Response:
        doc = await _body(request)
        name = doc.pop("name", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise BadRequest("give the tenant a 'name' (letters, digits and _)")
        exists = TenantExists(
            f"tenant {name!r} exists; change it with PATCH /admin/tenants/{name} "
            f"(infergate tenant set {name} FIELD=VALUE ...)"
        )
        if any(s.tenant.name == name for s in engine.tenant_views()):
            raise exists
        _check_fields(doc, "tenant", f"tenants.{name}.")
        key = new_key()

        def change(document: TOMLDocument) -> None:
            # Asked again of the file, under the store's lock: concurrent adds of one name
            # all pass the check above, and each would overwrite the last one's key.
            if name in document.get("tenants", {}):
                raise exists
            section = document.setdefault("tenants", table(is_super_table=True))
            entry = table()
            _set(entry, doc)
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

    @routes.patch("/admin/tenants/{name}")
    async def set_tenant(request: Request) -> Response:
        name = request.path_params["name"]
        doc = await _body(request)
        _check_fields(doc, "tenant", f"tenants.{name}.")
        if not any(s.tenant.name == name for s in engine.tenant_views()):
            raise TenantNotFound(f"no tenant {name!r}. Hint: infergate tenant list")

        def change(document: TOMLDocument) -> None:
            section = document.setdefault("tenants", table(is_super_table=True))
            _set(section.setdefault(name, table()), doc)

        await store.edit(change)
        return _json(tenant_json(engine.tenant_view(name)))

    @routes.delete("/admin/tenants/{name}")
    async def remove_tenant(request: Request) -> Response:
        name = request.path_params["name"]
        if not any(s.tenant.name == name for s in engine.tenant_views()):
            raise TenantNotFound(f"no tenant {name!r}. Hint: infergate tenant list")

        def change(document: TOMLDocument) -> None:
            section = document.get("tenants", {})
            if name in section:
                del section[name]

        await store.edit(change)
        return _json({})

    @routes.get("/admin/breakers")
    async def list_breakers(_: Request) -> Response:
        return _json(
            [
                breaker_json(v.breaker, BREAKER_FIELDS)
                for m in engine.model_views()
                for v in m.versions
            ]
        )

    @routes.patch("/admin/breakers/{model}")
    async def set_breaker(request: Request) -> Response:
        model = request.path_params["model"]
        doc = await _body(request)
        _check_fields(doc, "breaker", f"breaker.models.{model}.")
        engine.model(check_model_name(model))  # 404 for an unknown model

        def change(document: TOMLDocument) -> None:
            breaker = document.setdefault("breaker", table())
            models = breaker.setdefault("models", table(is_super_table=True))
            _set(models.setdefault(model, table()), doc)

        await store.edit(change)
        return _json(
            {
                "model": model,
                "policy": {
                    k: getattr(engine.context.settings.breaker_models[model], k)
                    for k in BREAKER_FIELDS
                },
            }
        )

    @routes.post("/admin/breakers/{model}/reset")
    async def reset_breaker(request: Request) -> Response:
        engine.reset_breakers(check_model_name(request.path_params["model"]))
        return _json({})

    return routes
